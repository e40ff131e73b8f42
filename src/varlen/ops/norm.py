"""Placeholder: being written."""


def layer_norm(*args, **kwargs):
    raise NotImplementedError("varlen.layer_norm is being written")

