"""Pagoda: phase-aware, integrity-checked LLM serving on Kubernetes."""

__version__ = "0.1.0"
