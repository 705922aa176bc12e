import pytest

from paratrain import ClusterEnv, ConfigError


def test_no_launcher_variables_means_one_local_process():
    env = ClusterEnv.from_environ({})
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)


def test_torchrun_variables_are_read():
    env = ClusterEnv.from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.launched, env.is_main) == ("10.0.0.1", 29400, True, False)


@pytest.mark.parametrize("environ, words", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside"),
])
def test_bad_launcher_variables_give_one_line_errors(environ, words):
    with pytest.raises(ConfigError, match=words) as info:
        ClusterEnv.from_environ(environ)
    assert "\n" not in str(info.value)
