"""crossbar: a streaming reverse proxy for fleets of llama.cpp ``llama-server`` hosts.

The specification is ``docs/design.md`` (kept beside the project); module docstrings name
the section each rule comes from.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
"""crossbar's version, written only here (pyproject.toml reads it: ``dynamic``)."""
