"""Placeholder: being written."""


def select(*args, **kwargs):
    raise NotImplementedError("varlen.select is being written")

