"""A small convolutional U-Net in plain TensorFlow ops (the Keras model of examples/train_convnet.py in functional
form): two down blocks, a bottleneck, two up blocks that concatenate the skip connections of the down path, and a
1x1 classifier per pixel. Parameters are a flat dict of tensors passed as function arguments."""

import math

import numpy as np
import tensorflow as tf


def _conv(x, w, b):
  return tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME") + b)


def loss_fn(prm, images, labels):
  """The U-Net's mean per-pixel cross-entropy (3 classes)."""
  def block(x, name):
    return _conv(_conv(x, prm[name + "_a/w"], prm[name + "_a/b"]), prm[name + "_b/w"], prm[name + "_b/b"])

  def up(x):
    return tf.repeat(tf.repeat(x, 2, axis=1), 2, axis=2)

  d1 = block(images, "down1")
  d2 = block(tf.nn.max_pool2d(d1, 2, 2, "VALID"), "down2")
  mid = block(tf.nn.max_pool2d(d2, 2, 2, "VALID"), "mid")
  u2 = block(tf.concat([up(mid), d2], axis=-1), "up2")
  u1 = block(tf.concat([up(u2), d1], axis=-1), "up1")
  logits = tf.nn.conv2d(u1, prm["classifier/w"], 1, "SAME") + prm["classifier/b"]
  # per pixel, kept [batch, rows, cols]: the sparse cross-entropy op flattens them, which moves the shard
  # boundaries of a batch and rows split together (a gather; README, Known limitations)
  picked = tf.one_hot(labels, logits.shape[-1]) * tf.nn.log_softmax(logits)
  return -tf.reduce_mean(tf.reduce_sum(picked, axis=-1))


def param_shapes(width, channels=3, classes=3):
  """{name: shape} of the U-Net whose first level has `width` channels."""
  w = width
  shapes = {}
  for name, cin, cout in (("down1", channels, w), ("down2", w, 2 * w), ("mid", 2 * w, 4 * w),
                          ("up2", 6 * w, 2 * w), ("up1", 3 * w, w)):
    shapes.update({name + "_a/w": (3, 3, cin, cout), name + "_a/b": (cout,), name + "_b/w": (3, 3, cout, cout),
                   name + "_b/b": (cout,)})
  shapes.update({"classifier/w": (1, 1, w, classes), "classifier/b": (classes,)})
  return shapes


def init_params(shapes, seed=0):
  """He-normal kernels, zero biases."""
  rng = np.random.default_rng(seed)
  return {k: (rng.normal(0.0, math.sqrt(2.0 / np.prod(s[:-1])), s) if len(s) > 1 else np.zeros(s)).astype(np.float32)
          for k, s in sorted(shapes.items())}


def synthetic_batch(batch, size, seed=1):
  """(images [batch, size, size, 3], labels [batch, size, size] in 0..2)."""
  rng = np.random.default_rng(seed)
  return (rng.normal(0.0, 1.0, (batch, size, size, 3)).astype(np.float32),
          rng.integers(0, 3, (batch, size, size)).astype(np.int32))
