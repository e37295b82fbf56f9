"""Train a U-Net-style segmentation network with the image's rows split over devices (spatial partitioning).

  python examples/train_convnet.py                    # mesh 2,4: batch over `data`, image rows over `spatial`
  python examples/train_convnet.py --mesh=1,8         # rows only
  python examples/train_convnet.py --plan             # the plan for 2048 devices, no devices

Keras 3 model: two down blocks (3x3 SAME convolutions, 2x2 max pooling), a bottleneck, two up blocks (2x
nearest upsampling, skip concatenation, 3x3 convolutions) and a 1x1 classifier per pixel. Each device holds
a band of rows of every activation; a 3x3 convolution exchanges one halo row with each neighbour instead of
gathering the image. Data: synthetic images of noisy discs and squares on a textured background; the label
of each pixel is its shape class.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

import training  # noqa: E402

flags.DEFINE_integer("image_size", 64, "Image height and width: a multiple of 4 (two 2x2 poolings, undone by two "
                     "upsamplings), at least 12 (the shapes drawn in it).", lower_bound=12)
flags.DEFINE_integer("width", 16, "Channels of the first block (doubled per down block).", lower_bound=1)
flags.DEFINE_integer("batch", 8, "Global batch size.", lower_bound=1)
flags.adopt_module_key_flags(training)   # --help lists the shared flags (--mesh, --steps, --plan, ...) too
flags.register_validator("image_size", lambda v: v % 4 == 0, "give a multiple of 4: the U-Net pools twice by 2 and "
                         "joins each upsampled map with the map of the same size")
flags.register_validator("auto_parallel", lambda v: not v, "the convnet has no --auto_parallel model (the "
                         "transformer and MoE binaries do): leave it out")
training.check_meshes(lambda values: ([("data", "spatial")], (64, 32)))
FLAGS = flags.FLAGS

CLASSES = 3   # background, disc, square


def unet(size, width):
  import keras  # pylint: disable=g-import-not-at-top
  from keras import layers  # pylint: disable=g-import-not-at-top

  def block(x, channels, name):
    x = layers.Conv2D(channels, 3, padding="same", activation="relu", name=name + "_a")(x)
    return layers.Conv2D(channels, 3, padding="same", activation="relu", name=name + "_b")(x)

  images = keras.Input((size, size, 3), batch_size=FLAGS.batch)
  d1 = block(images, width, "down1")
  d2 = block(layers.MaxPooling2D(2, name="pool1")(d1), 2 * width, "down2")
  mid = block(layers.MaxPooling2D(2, name="pool2")(d2), 4 * width, "mid")
  u2 = layers.Concatenate(name="skip2")([layers.UpSampling2D(2, name="up2")(mid), d2])
  u2 = block(u2, 2 * width, "up2_conv")
  u1 = layers.Concatenate(name="skip1")([layers.UpSampling2D(2, name="up1")(u2), d1])
  u1 = block(u1, width, "up1_conv")
  logits = layers.Conv2D(CLASSES, 1, name="classifier")(u1)
  return keras.Model(images, logits)


def synthetic_batch(k, size, batch, seed):
  """Images with one disc and one square each (random places and colours) and their per-pixel classes."""
  rng = np.random.default_rng(seed * 1_000_003 + k)
  yy, xx = np.mgrid[0:size, 0:size]
  images = rng.normal(0.0, 0.3, (batch, size, size, 3)).astype(np.float32)
  labels = np.zeros((batch, size, size), np.int32)
  for b in range(batch):
    r = rng.integers(size // 10, size // 5)
    cy, cx = rng.integers(r, size - r, 2)
    disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    h = rng.integers(size // 10, size // 5)
    sy, sx = rng.integers(0, size - 2 * h, 2)
    square = (yy >= sy) & (yy < sy + 2 * h) & (xx >= sx) & (xx < sx + 2 * h)
    labels[b][disc] = 1
    labels[b][square & ~disc] = 2
    images[b][disc] += rng.uniform(0.5, 1.0, 3)
    images[b][square & ~disc] -= rng.uniform(0.5, 1.0, 3)
  return images, labels


def task():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_gspmd import P  # pylint: disable=g-import-not-at-top

  def build(mesh, plan_only=False):  # pylint: disable=unused-argument
    import keras  # pylint: disable=g-import-not-at-top
    keras.utils.set_random_seed(FLAGS.seed)
    model = unet(FLAGS.image_size, FLAGS.width)
    optimizer = keras.optimizers.Adam(FLAGS.lr)
    optimizer.build(model.trainable_variables)

    def step(images, labels):
      with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
      optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
      return loss

    return training.Model(step=step, trackables={"model": model, "optimizer": optimizer})

  def in_specs(mesh):
    batch_axis = "data" if "data" in mesh.axis_names else None
    return (P(batch_axis, "spatial", None, None), P(batch_axis, "spatial", None))

  return training.Task(
      name="convnet", axes=("data", "spatial"), default_mesh=(2, 4), default_plan_mesh=(64, 32), build=build,
      batch=lambda k: synthetic_batch(k, FLAGS.image_size, FLAGS.batch, FLAGS.seed), in_specs=in_specs,
      unit="images", per_step=FLAGS.batch)


def main(_):
  training.run(task())


if __name__ == "__main__":
  app.run(main)
