"""The platform: the one adapter to TF's private APIs, and processes (clusters on TF's gRPC runtime)."""
