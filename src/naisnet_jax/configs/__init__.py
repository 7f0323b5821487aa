"""Configs shipped with the package; every experiment config starts from ``default.get_config()``."""
