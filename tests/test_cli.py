"""train_cli.py, train.py's command line (parse_cli): the toy defaults and the local server follow
the parsed --model and --vllm_server_base_url, whichever form argv spells them in."""
import pytest

import toy
import train_cli
from config import AsyncGRPOConfig


def parse(*argv: str):
    return train_cli.parse_cli(list(argv))


def test_the_toy_model_gets_its_defaults_and_a_local_server_in_either_form():
    script, config = parse("--model=toy")
    assert (script, config) == parse("--model", "toy") == parse()
    assert script.serve_local is True
    assert {k: getattr(config, k) for k in toy.TRAIN_DEFAULTS} == toy.TRAIN_DEFAULTS


@pytest.mark.parametrize("argv", [["--model=some/other"], ["--model", "some/other"]])
def test_another_model_gets_no_toy_defaults_and_no_local_server(argv):
    script, config = parse(*argv)
    assert script.model == "some/other"
    assert config == AsyncGRPOConfig()
    assert script.serve_local is False


def test_given_fields_win_over_the_toy_defaults_in_either_form():
    script, config = parse("--model=toy", "--learning_rate=0.1", "--num_generations", "4")
    assert (config.learning_rate, config.num_generations) == (0.1, 4)
    assert config.output_dir == toy.TRAIN_DEFAULTS["output_dir"]
    for url in (["--vllm_server_base_url=http://gpu0:8000"],
                ["--vllm_server_base_url", "http://localhost:8000"]):   # the default, given
        assert parse(*url)[0].serve_local is False
    assert parse("--model=some/other", "--serve_local=true")[0].serve_local is True
