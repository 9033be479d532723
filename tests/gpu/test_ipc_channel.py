"""Weights over CUDA IPC between processes sharing one GPU (the colocated placement, where NCCL refuses two
ranks on one device): a sender and two receivers, each a process of its own on GPU 0; the second receiver
stages each sync beside the model's work, as a generating rollout does, without its reserved memory growing
from sync to sync."""

from __future__ import annotations

import multiprocessing
import time

import torch

from services.common.channel import open_weight_channel
from services.common.gloo_channel import prepare_gloo_rendezvous
from services.common.weight_sync import StagedWeights, WeightReceiver, WeightSender, tensor_checksum
from tests.gpu.conftest import needs

WORLD = 3
VERSIONS = (1, 2, 3, 4)


def model_like() -> list[tuple[str, torch.Tensor]]:
    """Tensors of several dtypes and sizes, some over the channel's small-tensor limit, some under."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 896), (896,), (151936, 896), (3,), (128, 128), (4864, 896)]
    return [(f"layer.{i}.weight", torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16))
            for i, shape in enumerate(shapes)] + [("step", torch.tensor([7], device="cuda"))]


def member(rank: int, rendezvous: bytes, results) -> None:
    torch.cuda.set_device(0)
    channel = open_weight_channel("ipc-test", "cuda_ipc", rendezvous=rendezvous, rank=rank, world_size=WORLD,
                                  timeout_s=60, device="cuda:0")
    try:
        seconds, reserved = [], []
        sender, receiver = WeightSender(), WeightReceiver()
        for version in VERSIONS:
            named = [(name, tensor + version if tensor.is_floating_point() else tensor)
                     for name, tensor in model_like()]
            torch.cuda.synchronize()
            started = time.perf_counter()
            if rank == 0:
                sender.send(channel, named, version, bucket_bytes=64 << 20)
                got = {name: tensor_checksum(tensor) for name, tensor in named}
            elif rank == 1:
                got = {}
                received = receiver.receive(channel, lambda pairs: got.update(
                    (name, tensor_checksum(tensor)) for name, tensor in pairs))
                assert received == version
            else:
                staged = StagedWeights(channel, receiver)
                assert staged.wait(60) and staged.version == version
                got = {name: tensor_checksum(tensor) for bucket in staged.buckets for name, tensor in bucket}
                del staged
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            reserved.append(torch.cuda.memory_reserved())
        results.put((rank, got, seconds, reserved))
    except BaseException as error:  # noqa: BLE001 - handed back to the test
        results.put((rank, repr(error), [], []))
    finally:
        channel.close()


@needs(1, vllm=False)
def test_weights_reach_two_receivers_on_the_senders_gpu_over_cuda_ipc():
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 60)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    members = [context.Process(target=member, args=(rank, rendezvous, results)) for rank in range(WORLD)]
    for process in members:
        process.start()
    outcomes = {rank: (got, seconds, reserved) for rank, got, seconds, reserved in
                (results.get(timeout=120) for _ in members)}
    for process in members:
        process.join(30)
    del store
    for rank, (got, _, _) in outcomes.items():
        assert isinstance(got, dict), f"rank {rank}: {got}"
    sent = outcomes[0][0]
    assert len(sent) == len(model_like())
    assert outcomes[1][0] == sent and outcomes[2][0] == sent  # the last version, every tensor, byte for byte
    nbytes = sum(t.numel() * t.element_size() for _, t in model_like())
    staged_reserved = outcomes[2][2]
    print(f"\ncuda_ipc, one GPU, 2 receivers: {nbytes / 1e6:.0f} MB; second sync {outcomes[0][1][1] * 1e3:.1f} ms "
          f"at the sender ({nbytes / outcomes[0][1][1] / 1e9:.0f} GB/s); the staging receiver's reserved memory "
          f"after each sync: {', '.join(f'{r / 2**20:.0f}' for r in staged_reserved)} MiB")
    assert staged_reserved[-1] == staged_reserved[1]  # each sync's staged buckets reuse the last one's memory
