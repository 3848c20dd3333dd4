"""Placeholder: GGUFTensor lands in a later commit."""
import torch
class GGUFTensor(torch.Tensor):
    pass
