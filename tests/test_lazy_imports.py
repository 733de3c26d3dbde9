"""What importing Cadence costs: the engine and the command line load no model library until a run needs one."""

from __future__ import annotations

import subprocess
import sys

# Libraries only a real model needs (torch and what it drags in), the servers' metrics, the
# tokenizer and the structured-output grammar library: none of them may load before a
# command asks for a model (or a request for structured output).
HEAVY = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "prometheus_client",
         "xgrammar")


def modules_after(code: str) -> set[str]:
    """The top-level module names a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_importing_the_engine_and_the_cli_loads_no_model_library():
    loaded = modules_after("import cadence.actors, cadence.actors.cli, cadence.actors.llm")
    assert "cadence" in loaded
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_the_gpu_package_and_its_light_modules_load_without_torch():
    loaded = modules_after("import cadence.gpu, cadence.gpu.config, cadence.gpu.errors")
    assert "torch" not in loaded
    loaded = modules_after("from cadence.gpu import Tokenizer")
    assert "tokenizers" in loaded and "torch" not in loaded


def test_building_and_running_a_model_does_not_load_the_compiler_stack():
    code = (
        "from cadence.gpu import ModelRunner, preset\n"
        "from cadence.statemachine.plan import NewRequestData, StepPlan\n"
        "from cadence.statemachine.sampling import SamplingParams\n"
        "runner = ModelRunner(preset('tiny'), num_blocks=4, block_size=4, device='cpu')\n"
        "plan = StepPlan(0, {'a': 3}, 3, [NewRequestData('a', [3, 4, 5], 3, [0], 0)], {}, [], [], [])\n"
        "assert 'a' in runner.execute(plan, {'a': SamplingParams(temperature=0.0)}).sampled_token_ids\n"
        "import sys\n"
        "print(' '.join(m for m in sys.modules if m.startswith('torch._dynamo') or m == 'triton'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
