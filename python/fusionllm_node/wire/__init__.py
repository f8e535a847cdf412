"""Protocol stubs generated from proto/*.proto when the package is built (see setup.py)."""
