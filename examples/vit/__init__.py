"""A compact Vision Transformer on scikit-learn's digits: the model, the data, and its pretraining.

examples/ is not installed: scripts in examples/ import this folder as ``vit`` (their own folder is on
sys.path), e.g. ``from vit.model import ViT, ViTConfig``.
"""
