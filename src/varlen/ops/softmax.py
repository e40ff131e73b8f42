"""Placeholder: being written."""


def softmax(*args, **kwargs):
    raise NotImplementedError("varlen.softmax is being written")

