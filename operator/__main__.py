"""``python -m pagoda.operator`` runs the operator."""

from .main import main

main()
