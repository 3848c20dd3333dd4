import os
import sys

import pytest
import torch

torch.manual_seed(0)
