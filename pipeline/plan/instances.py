"""Accelerator instances the planner knows: NeuronCores and device memory (HBM).

Each Inferentia2 chip has 2 NeuronCores sharing 32 GiB of HBM; a Trainium1 chip also has
2 NeuronCores and 32 GiB (trn1 hosts are common compile machines).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Instance:
    name: str
    chips: int
    cores_per_chip: int = 2
    hbm_per_chip: int = 32 * GIB

    @property
    def cores(self) -> int:
        return self.chips * self.cores_per_chip

    @property
    def hbm_per_core(self) -> int:
        return self.hbm_per_chip // self.cores_per_chip


INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance("inf2.xlarge", chips=1),
        Instance("inf2.8xlarge", chips=1),
        Instance("inf2.24xlarge", chips=6),
        Instance("inf2.48xlarge", chips=12),
        Instance("trn1.2xlarge", chips=1),
        Instance("trn1.32xlarge", chips=16),
        Instance("trn1n.32xlarge", chips=16),
        # Trainium2: 8 physical NeuronCores and 96 GiB per chip, seen as 4 logical cores
        # (the default logical-core size 2).
        Instance("trn2.48xlarge", chips=16, cores_per_chip=4, hbm_per_chip=96 * GIB),
    )
}
# The families optimum-neuron's --instance_type takes (SUPPORTED_INSTANCE_TYPES,
# optimum/neuron/utils/instance.py:24, used by optimum/commands/export/neuronx.py:48-56).
NEURON_FAMILIES = ("trn1", "inf2", "trn1n", "trn2")


def neuron_family(instance_type: str) -> str:
    """``inf2.8xlarge`` → ``inf2``: the exporter's --instance_type for an instance type."""
    family = instance_type.split(".", 1)[0]
    if family not in NEURON_FAMILIES:
        raise ValueError(
            f"instance type '{instance_type}' is not a Neuron instance "
            f"(families: {', '.join(NEURON_FAMILIES)})"
        )
    return family
