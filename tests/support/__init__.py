"""Helpers for the tests (import them from here, never from conftest)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository checkout."""
