"""loadgen"""
