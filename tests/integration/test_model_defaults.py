"""Through the whole stack: a model folder whose generation_config.json recommends greedy decoding
(temperature 0) answers a request that leaves temperature out greedily — on chat completions and on
the Responses API — while a request that sets its own temperature samples as it asked."""
import json
import shutil

import openai
import pytest

from tests.conftest import start_stack, stop_stack

PROMPT = [{"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture(scope="module")
def greedy_folder_stack(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("defaults") / "greedy-by-default"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.0}))
    stack = start_stack(folder, tmp_path_factory.mktemp("stack-defaults"), "paged")
    yield stack
    stop_stack(stack.proc)


def test_a_left_out_temperature_is_the_folders_and_a_given_one_is_the_clients(greedy_folder_stack):
    client = openai.OpenAI(base_url=f"{greedy_folder_stack.url}/v1", api_key=greedy_folder_stack.key)

    def chat(**kw) -> str:
        out = client.chat.completions.create(model="demo", messages=PROMPT, max_tokens=16, seed=3, **kw)
        return out.choices[0].message.content

    greedy = chat(temperature=0)
    assert chat() == greedy  # the folder's temperature 0
    assert chat(temperature=1.0) != greedy  # the client's own 1.0, seeded: sampled
    answer = client.responses.create(model="demo", input="Tell me about the sea", max_output_tokens=16)
    assert answer.output_text == greedy
    log = (greedy_folder_stack.state / "worker.log").read_text()
    assert "sampling defaults from the model's generation_config.json" in log and "temperature=0" in log
