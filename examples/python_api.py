"""accelab from Python, notebook style: your own model object, measured, verified, tuned, applied.

    python examples/python_api.py            # a few minutes on a 2-core CPU

Each cell is what you would type in a notebook. The model is a class defined right here (in
__main__), as in a notebook: accelab saves the object once and every measurement runs it in its
own process, so compile and quantization never leak into your session. The Results go to the
same store as the CLI's (`accelab history` lists them).
"""

import torch
from torch import nn

import accelab
from accelab.results import compare_table


# %% A model that exists only as a Python class
class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1, stride=2), nn.ReLU(),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3)))


torch.manual_seed(0)
net = SmallNet().eval()
example = torch.randn(1, 3, 64, 64)  # one input, batch first: accelab repeats it to any batch
quick = {"batch_size": 8, "min_seconds": 0.5, "min_iters": 3, "warmup": 1}

# %% One measurement: latency, throughput, memory and MFU of the fp32 baseline
result = accelab.bench(net, plan="baseline", workload=quick, inputs=example)
print(f"baseline: {result.metrics['throughput']:.1f} images/s, p50 {result.metrics['latency_ms']['p50']:.2f} ms")

# %% Plans side by side, each checked against the fp32 reference on real photos
results = accelab.compare(net, plans=["baseline", "channels-last", "bf16", "sdpa"], workload=quick, inputs=example)
compare_table.render(results, title="SmallNet · forward · batch 8")

# %% Did a plan change the outputs? (128 photos by default: fewer agreeing ones cannot show top-1 >= 0.95)
check = accelab.verify(net, plan="channels-last", inputs=example)
print(f"verify channels-last: {check.quality['verdict']} (top-1 agreement {check.quality['metrics']['top1_agreement']:.2f})")

# %% The fastest plan under a quality limit, as a Plan you can save and reuse
best = accelab.tune(net, inputs=example, include=["baseline", "channels-last"], max_batch=8, min_seconds=0.5,
                    quality="balanced", out="smallnet-best.yaml")
print(f"tune picked {best.name} (batch {best.batch_size}); written to smallnet-best.yaml")

# %% Put that plan into your own serving code: the same object, accelerated in this process
with torch.inference_mode():
    before = net(example)
fast = accelab.apply(net, best)  # changes `net` in place (as torch.compile and quantize_ do) and returns it in .model
with torch.inference_mode():
    same = torch.allclose(fast.model(example), before, atol=1e-4)
print(f"apply: {best.name}, notes: {fast.notes or ['none']}; outputs unchanged: {same}")
fast.close()  # restores the thread settings the plan changed
