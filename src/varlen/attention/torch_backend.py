"""Placeholder: the PyTorch attention backend is being written."""

NAME = "torch"


def unsupported_reasons(q, k, v, bias, alibi, problem, opts):
    return ["the PyTorch attention backend is being written"]
