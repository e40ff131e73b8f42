"""Placeholder: being written."""


def gelu(*args, **kwargs):
    raise NotImplementedError("varlen.gelu is being written")


def relu(*args, **kwargs):
    raise NotImplementedError("varlen.relu is being written")


def silu(*args, **kwargs):
    raise NotImplementedError("varlen.silu is being written")


def threshold(*args, **kwargs):
    raise NotImplementedError("varlen.threshold is being written")

