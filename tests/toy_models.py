"""Toy functions for the graph-diff tests: a base, one with an extra op, one with a graph break."""

import torch


def toy_base(x, w):
    y = torch.relu(x @ w)
    return y * 2


def toy_extra_op(x, w):
    y = torch.relu(x @ w)
    return torch.tanh(y * 2)


def toy_graph_break(x, w):
    y = torch.relu(x @ w)
    if y.sum().item() > 0:  # a data-dependent branch: Dynamo breaks the graph here
        y = y + 1
    return y * 2
