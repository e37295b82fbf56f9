"""tf_gspmd: GSPMD sharding completion and SPMD partitioning for TensorFlow."""

import os

from setuptools import setup

# Source directory -> the package it is installed as; every folder below one with an __init__.py is a subpackage.
PACKAGE_DIRS = {"tf_gspmd": "tf_gspmd", "tf_gspmd.ops": "ops", "tf_gspmd.rewriter": "rewriter"}


def _packages():
  found = []
  for package, directory in PACKAGE_DIRS.items():
    for root, _, files in os.walk(directory):
      if "__init__.py" in files:
        found.append(".".join([package] + os.path.relpath(root, directory).split(os.sep)[(root == directory):]))
  return sorted(set(found))


setup(
    name="tf_gspmd",
    version="0.1.0",
    description="GSPMD for TensorFlow: annotate a few tensors, run one SPMD program on every device of a mesh",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=_packages(),
    package_dir={"tf_gspmd": "tf_gspmd", "tf_gspmd.ops": "ops", "tf_gspmd.rewriter": "rewriter"},
    install_requires=["tensorflow>=2.16", "numpy", "absl-py", "rich", "tensorboard", "highspy>=1.7"],
    extras_require={
        # Model Explorer for gs.explore (the HTML page, report.save_html, needs nothing more)
        "explore": ["ai-edge-model-explorer==0.1.34"],
        # the browser tests drive Debian's Chromium with Playwright (its own browsers are not downloaded)
        "test": ["pytest", "pytest-xdist==3.8.0", "hypothesis", "keras-hub==0.32.0", "ai-edge-model-explorer==0.1.34", "playwright==1.65.2"],
    },
)
