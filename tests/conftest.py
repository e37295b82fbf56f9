"""Test session set-up: 8 logical CPU devices before TensorFlow initialises, and shared helpers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tf_gspmd as gs  # noqa: E402

NUM_DEVICES = 8


gs.split_cpu_devices(NUM_DEVICES)


@pytest.fixture
def rng():
  return np.random.default_rng(0)


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)
