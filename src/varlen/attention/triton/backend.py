"""Placeholder: the Triton attention backend is being written."""

NAME = "triton"


def unsupported_reasons(q, k, v, bias, alibi, problem, opts):
    return ["the Triton attention backend is being written"]
