import os
import sys

import pytest
import torch

torch.manual_seed(0)


def real_model_path():
    """The default real model where the library keeps it (``$HANZO_CACHE``, else ``~/.cache/hanzo-torch``);
    skips the calling test with one reason when it has not been downloaded (``hanzo-torch pull``)."""
    from hanzo_torch import hub

    path = hub.model_path()
    if not path.is_file():
        pytest.skip(f"real model not downloaded: {path} is absent (run `hanzo-torch pull`)")
    return path
