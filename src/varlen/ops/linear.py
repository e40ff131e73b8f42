"""Placeholder: being written."""


def linear(*args, **kwargs):
    raise NotImplementedError("varlen.linear is being written")


def matmul(*args, **kwargs):
    raise NotImplementedError("varlen.matmul is being written")


def transposed_matmul(*args, **kwargs):
    raise NotImplementedError("varlen.transposed_matmul is being written")

