"""The per-device back end: clean-up and checks, XLA segments and export, horizontal fusion, constants."""
