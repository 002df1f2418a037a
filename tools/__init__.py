"""Repository tools (run as scripts; importable so tests can reuse their checks)."""
