"""Keras internals: layout maps chosen by automatic sharding."""
