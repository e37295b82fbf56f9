"""Test session set-up: 8 logical CPU devices before TensorFlow initialises, and shared helpers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_DEVICES = 8


def _split_cpu():
  cpus = tf.config.list_physical_devices("CPU")
  try:
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES)
  except RuntimeError:  # already initialised by an earlier import in this process
    pass


_split_cpu()


@pytest.fixture
def rng():
  return np.random.default_rng(0)


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)
