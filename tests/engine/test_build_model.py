"""engine.models.base.build_model: the model is built on the meta device and materialized in the
requested dtype, without torch's Python references (which import sympy, a large import an
eager worker does not otherwise need)."""

import subprocess
import sys

import torch

from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import build_model
from pdcluster.engine.models.llama import LlamaForCausalLM


def test_every_tensor_is_materialized_in_the_dtype_and_frozen():
    config = ModelConfig.from_pretrained(BUNDLED_MODEL)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    model = build_model(config, torch.bfloat16, "cpu")
    assert ({name: p.shape for name, p in model.named_parameters()}
            == {name: p.shape for name, p in meta.named_parameters()})
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert param.dtype == torch.bfloat16, name
        assert not param.requires_grad, name
    assert not model.training


def test_building_a_model_imports_no_sympy():
    code = ("import sys, torch; from pdcluster.engine.config import BUNDLED_MODEL; "
            "from pdcluster.engine.model_config import ModelConfig; "
            "from pdcluster.engine.models.base import build_model; "
            "build_model(ModelConfig.from_pretrained(BUNDLED_MODEL), torch.float32, 'cpu'); "
            "print('sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
