import pytest

from paratrain import ClusterEnv, ConfigError


def test_no_launcher_variables_means_one_local_process():
    env = ClusterEnv.from_environ({})
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)


def test_torchrun_variables_are_read():
    env = ClusterEnv.from_environ(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.launched, env.is_main) == ("10.0.0.1", 29400, True, False)


@pytest.mark.parametrize(
    "environ, words",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside"),
    ],
)
def test_bad_launcher_variables_give_one_line_errors(environ, words):
    with pytest.raises(ConfigError, match=words) as info:
        ClusterEnv.from_environ(environ)
    assert "\n" not in str(info.value)


def test_a_process_joining_a_group_made_before_it_needs_only_the_ranks():
    """Ray Train starts the group itself; with init_method="tcp" it sets no MASTER_ADDR or MASTER_PORT."""
    env = ClusterEnv.from_environ(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, joined=True
    )
    assert (env.rank, env.local_rank, env.world_size, env.master_port, env.launched) == (1, 1, 2, None, True)


def test_a_group_whose_ranks_differ_from_the_environment_is_refused():
    import torch
    import torch.distributed as dist

    from paratrain.distributed.process_group import start_process_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    env = ClusterEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, launched=True)
    with pytest.raises(
        ConfigError,
        match=r"^the existing process group puts this process at rank 0 of 1 but "
        r"RANK=1, WORLD_SIZE=2; start the group",
    ):
        start_process_group(env, torch.device("cpu"), 10, needs_group=True)
    same = ClusterEnv(rank=0, world_size=1, launched=True)
    assert start_process_group(same, torch.device("cpu"), 10, needs_group=True) is False  # joined, not owned
