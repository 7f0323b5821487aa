"""Configs shipped with the package, one ``get_config()`` per experiment, each starting from
``default.get_config()``; :mod:`.schema` declares every field once."""
