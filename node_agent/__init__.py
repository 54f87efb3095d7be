"""node_agent"""
