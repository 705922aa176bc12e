"""``paratrain plan``: memory per GPU, step time and scaling of every strategy, and which one to use.

Examples:
  paratrain plan --model gpt2-medium --gpus 8 --gpu h100 --interconnect nvlink
  paratrain plan --params 7.5B --layers 32 --hidden 4096 --seq-len 4096 --gpus 8 --nodes 4 --inter-node eth-100g
  paratrain plan --model mymodels:build --input 3x224x224 --gpu a100-40gb --gpus 4 --breakdown
  paratrain plan --model model:build_gpt --input long:1024 --gpus 8 --batch 12 --global-batch 480 --base-batch 480
  paratrain plan --model mlp --gpu cpu --gpus 2 --measure
  paratrain plan --model mymodels:recommender --input long:8 --gpu cpu --gpus 3 --ps-servers 1 --optimizer sgd
  paratrain plan --model llama-7b --gpus 8 --nodes 2 --tp 8
  paratrain plan --model llama3-70b --gpus 8 --nodes 48 --layout dp=8,pp=12,tp=4 --global-batch 2048
  paratrain plan --model gpt3-175b --gpu a100 --gpus 8 --nodes 8 --inter-node ib-hdr-x8 --layout pp=8,tp=8 \
      --batch 1 --global-batch 64 --recompute selective --schedule interleaved-1f1b --virtual-stages 2
  paratrain plan --model-config ./Mistral-7B/config.json --seq-len 4096 --gpus 8
  paratrain plan --model mymodels:build_gpt --tp 2 --show-tp-plan
  paratrain plan --dry-run --world 128 --strategy zero3 --tp 8 --model-config ./Llama-3-8B/config.json

Nothing is allocated or launched: a built-in GPT or --params uses closed forms, any other model is traced on
the meta device, called as training calls it (targets to a forward that takes them, its own loss; --targets).
Memory is in GiB (2**30 bytes), bandwidth in GB/s. See docs/planner.md.
"""
from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="estimate memory and step time per strategy and recommend one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", help="mlp, cnn, gpt2[-medium|-large|-xl], llama-7b, gpt3-175b, llama3-8b/70b/405b, "
                                   "mistral-7b, qwen2-7b, or module:factory")
    m.add_argument("--input", dest="input_spec", metavar="SHAPE",
                   help="one sample's input for module:factory, e.g. 3x224x224 or long:1024")
    m.add_argument("--targets", metavar="SHAPE",
                   help="one sample's targets, passed to the forward's targets/labels parameter (long:1024, or long for "
                        "one class id); none: trace the forward on its input alone. Default: given when the forward "
                        "takes them, one per input token for token ids, else one class id")
    m.add_argument("--model-config", metavar="PATH",
                   help="a transformers config.json (or its checkpoint directory): llama, mistral, qwen2 or gpt2")
    m.add_argument("--params", help="plan a transformer of this many parameters, e.g. 7.5B (no --model)")
    for flag in ("--layers", "--hidden", "--heads", "--kv-heads", "--ffn-hidden", "--seq-len", "--vocab"):
        m.add_argument(flag, type=int, help="transformer shape (overrides a built-in GPT's or a config's)")
    m.add_argument("--tied", dest="tied", action="store_const", const=True,
                   help="the output head shares the token embedding's weights")
    m.add_argument("--untied", dest="tied", action="store_const", const=False, help="a separate output head")
    m.add_argument("--measure", action="store_true",
                   help="run the model here: on the CPU for its activations and step time (calibrates --gpu cpu); "
                        "on this machine's GPU, timed steps calibrate that GPU's compute and bandwidth")
    h = p.add_argument_group("hardware")
    h.add_argument("--gpu", default="h100", help="a100-40gb, a100-80gb, h100-80gb, h200-141gb, l4, rtx-4090, cpu")
    h.add_argument("--gpus", type=int, default=1, help="GPUs (or CPU processes) per node")
    h.add_argument("--nodes", type=int, default=1)
    h.add_argument("--interconnect", help="link within a node: nvlink, nvlink3, nvlink4, pcie3/4/5[-x8|-x4], loopback-gloo")
    h.add_argument("--inter-node", help="link between nodes: ib-hdr, ib-ndr (one port a node), ib-hdr-x8, ib-ndr-x8 "
                                        "(one a GPU), eth-10g/25g/100g/200g/400g, roce-*")
    h.add_argument("--gpu-mem-gb", type=float, help="override device memory (GiB)")
    h.add_argument("--tflops", type=float, help="override peak TFLOP/s")
    h.add_argument("--mfu", type=float, help="a whole step's sustained fraction of peak (default: A100/H100/H200 0.7 "
                                             "in matmuls plus elementwise passes, other GPUs 0.4, CPU 0.6)")
    h.add_argument("--mem-bw-gbs", type=float, help="override device memory bandwidth (GB/s)")
    h.add_argument("--intra-bw-gbs", type=float, help="override intra-node bandwidth (GB/s, one direction)")
    h.add_argument("--inter-bw-gbs", type=float, help="override inter-node bandwidth (GB/s per node)")
    h.add_argument("--step-time", type=float, metavar="SECONDS",
                   help="measured seconds of one training step of --batch on one device: calibrates the MFU")
    h.add_argument("--optimizer-time", type=float, metavar="SECONDS",
                   help="the optimizer step of that measurement timed apart (then --step-time is forward+backward "
                        "alone): calibrates the memory bandwidth too")
    h.add_argument("--threads", type=int, help="with --gpu cpu: the cores the measured step ran on")
    t = p.add_argument_group("training")
    t.add_argument("--precision", default="auto", help="fp32, bf16-mixed, fp16-mixed (auto: fp32 on cpu, else bf16-mixed)")
    t.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd-momentum")
    t.add_argument("--batch", dest="micro_batch", type=int, default=8, help="per-GPU micro-batch (default 8)")
    t.add_argument("--global-batch", type=int, help="samples per optimizer step (default batch x GPUs)")
    t.add_argument("--micro-batches", type=int, help="pipeline micro-batches per step")
    t.add_argument("--schedule", default="1f1b", help="pipeline schedule: 1f1b, gpipe or interleaved-1f1b")
    t.add_argument("--virtual-stages", type=int, help="with --schedule interleaved-1f1b: stages per rank (default 2)")
    t.add_argument("--checkpointing", action="store_true", help="plan with activation checkpointing of every block")
    t.add_argument("--recompute", choices=("none", "selective", "op", "full"),
                   help="activation recomputation: full (= --checkpointing), selective (the attention core: "
                        "Korthikanti et al. 2022), op (torchtitan's per-op selective AC) or none")
    t.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true", default=True,
                   help="tensor parallelism shards norms and residuals on the sequence (default, as paratrain runs it)")
    t.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="plain tensor parallelism: every tp rank keeps them whole")
    t.add_argument("--tp", type=int, help="tensor-parallel degree to plan (default: every one that divides a node "
                                          "and the model; 1: none; more than a node's GPUs is planned but slow)")
    t.add_argument("--dp", type=int, help="with --pp and/or --tp: plan exactly this layout (dp x pp x tp = all GPUs) "
                                          "instead of searching")
    t.add_argument("--pp", type=int, help="pipeline stages of the exact layout (default 1 with --dp)")
    t.add_argument("--layout", help="the exact layout in one flag, e.g. dp=8,pp=12,tp=4")
    t.add_argument("--base-batch", type=int, metavar="N",
                   help="the global batch your LR was tuned at: say how to scale it to this plan's global batch")
    t.add_argument("--base-lr", type=float, help="with --base-batch: that LR, printed scaled")
    t.add_argument("--ps-servers", type=int, default=1, metavar="S",
                   help="servers of the ps row (parameter servers: the other GPUs are workers; default 1, as "
                        "Parallel('ps'); 0: no ps row)")
    t.add_argument("--ps-rows-per-step", type=int, metavar="R",
                   help="ps: rows of each embedding table one worker's step touches (default: the distinct ids of "
                        "its samples' lookups, drawn uniformly: the most a step moves)")
    t.add_argument("--ps-table-optimizer", choices=("sgd", "adagrad", "adam"),
                   help="ps: what updates table rows on the servers (default: --optimizer's states; adam is SparseAdam)")
    o = p.add_argument_group("output")
    o.add_argument("--breakdown", action="store_true", help="show memory per category")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    d = p.add_argument_group("dry run (docs/large-models.md)")
    d.add_argument("--dry-run", action="store_true",
                   help="lay the model out as prepare would, on the meta device with a fake process group, and print "
                        "what each rank holds (or the error a launch would hit); with --world, --strategy, --tp, --dp")
    d.add_argument("--world", type=int, help="with --dry-run: the number of processes (default --gpus x --nodes)")
    d.add_argument("--strategy", default="zero3", help="with --dry-run: the strategy to lay out (default zero3)")
    o.add_argument("--show-tp-plan", nargs="?", const="model", choices=["model", "auto"],
                   help="with --tp N: print the tensor-parallel plan prepare would apply (the model's own or built-in "
                        "one, else inferred; 'auto': inferred even where one is built in) and plan nothing")


def execute(args: argparse.Namespace) -> int:
    if args.dry_run:
        return _dry_run(args)
    from ..errors import ConfigError
    from ..planner import exact_layout, format_plan, make_plan, plan_to_json
    from ..workloads.planning import resolve_model

    if args.checkpointing and args.recompute not in (None, "full"):
        raise ConfigError(f"--checkpointing is --recompute full; give one of --checkpointing or --recompute "
                          f"{args.recompute}")
    model = resolve_model(args.model, params=args.params, layers=args.layers, hidden=args.hidden, heads=args.heads,
                          seq_len=args.seq_len, vocab=args.vocab, ffn=args.ffn_hidden, kv_heads=args.kv_heads,
                          tied=args.tied, model_config=args.model_config, input_spec=args.input_spec,
                          targets=args.targets)
    if args.show_tp_plan:
        from .tp_plan import tp_plan_lines

        print("\n".join(tp_plan_lines(model, args.tp, infer=args.show_tp_plan == "auto")))
        return 0
    plan = make_plan(model, measure=args.measure, gpu=args.gpu, gpus=args.gpus, nodes=args.nodes,
                     interconnect=args.interconnect, inter_node=args.inter_node, gpu_mem_gb=args.gpu_mem_gb,
                     tflops=args.tflops, mfu=args.mfu, mem_bw_gbs=args.mem_bw_gbs, intra_bw_gbs=args.intra_bw_gbs,
                     inter_bw_gbs=args.inter_bw_gbs, step_time=args.step_time, optimizer_time=args.optimizer_time,
                     threads=args.threads, precision=args.precision, optimizer=args.optimizer,
                     micro_batch=args.micro_batch, global_batch=args.global_batch, micro_batches=args.micro_batches,
                     schedule=args.schedule, virtual_stages=args.virtual_stages, checkpointing=args.checkpointing,
                     recompute=args.recompute, sequence_parallel=args.sequence_parallel, tp=args.tp,
                     exact=exact_layout(args.layout, dp=args.dp, pp=args.pp, tp=args.tp), ps_servers=args.ps_servers,
                     rows_per_step=args.ps_rows_per_step, table_optimizer=args.ps_table_optimizer,
                     base_batch=args.base_batch, base_lr=args.base_lr)
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        print(format_plan(plan, breakdown=args.breakdown))
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    from ..dry_run import dry_run, model_builder

    options = {k: v for k, v in (("tp", args.tp), ("dp", args.dp)) if v is not None}
    result = dry_run(model_builder(args.model, args.model_config), world=args.world or args.gpus * args.nodes,
                     strategy=args.strategy, options=options,
                     precision="fp32" if args.precision == "auto" else args.precision, optimizer=args.optimizer,
                     per_node=args.gpus if args.world is None or args.gpus > 1 else 8)
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    return 1 if result.error is not None else 0
