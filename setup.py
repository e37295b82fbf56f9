"""tf_gspmd: GSPMD sharding completion and SPMD partitioning for TensorFlow."""

from setuptools import setup

setup(
    name="tf_gspmd",
    version="0.1.0",
    description="GSPMD for TensorFlow: annotate a few tensors, run one SPMD program on every device of a mesh",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["tf_gspmd", "tf_gspmd.ops", "tf_gspmd.rewriter", "tf_gspmd.rewriter.auto", "tf_gspmd.runtime"],
    package_dir={"tf_gspmd": "tf_gspmd", "tf_gspmd.ops": "ops", "tf_gspmd.rewriter": "rewriter"},
    install_requires=["tensorflow>=2.16", "numpy", "absl-py", "rich", "tensorboard", "highspy>=1.7"],
    extras_require={"test": ["pytest", "hypothesis", "keras-hub==0.32.0"]},
)
