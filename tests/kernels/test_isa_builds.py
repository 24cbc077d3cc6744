"""The C kernels compile for every ISA class they have a path for, not just this machine's.

`attention_cpu` builds them with -march=native, so the kernel tests compile only the paths of the
CPU they run on: a path for another class (AMX tiles on an AVX-512 EPYC, AVX-512 on an AVX2-only
one) could stop compiling unseen, and its machines then lose the kernel. Each build here is checked
for the path it must take (`parkade_attention_features()`'s bits come from the same macros).
"""

from __future__ import annotations

import subprocess

import pytest

from parkade.kernels import attention_cpu

TARGETS = {  # -march: the paths its build must have
    "haswell": "AVX2",
    "skylake-avx512": "AVX-512",
    "cooperlake": "AVX512-BF16",
    "sapphirerapids": "AMX",
}
SOURCES = (
    attention_cpu.SOURCE,
    attention_cpu.RACE_SOURCE,
    attention_cpu.LINEAR_SOURCE,
    attention_cpu.LINEAR_DPBF16_SOURCE,
)
# A translation unit after the kernel's own, that fails to compile unless the build took the path.
CHECKS = {
    "AVX2": "#if !defined(__AVX2__) || defined(__AVX512F__)\n#error not the AVX2 path\n#endif\n",
    "AVX-512": "#if !defined(__AVX512F__) || HAVE_DPBF16\n#error not the AVX-512 path\n#endif\n",
    "AVX512-BF16": "#if !HAVE_DPBF16 || HAVE_AMX\n#error not the AVX512-BF16 path\n#endif\n",
    "AMX": "#if !HAVE_AMX\n#error not the AMX path\n#endif\n",
}


@pytest.mark.parametrize("march", list(TARGETS))
def test_the_kernels_compile_for(march, tmp_path):
    compiler = attention_cpu._compiler()
    flags = [*attention_cpu.CFLAGS, *attention_cpu.OPENMP_FLAGS, f"-march={march}", "-Werror=implicit"]
    for header in attention_cpu.HEADERS:  # included from beside the sources
        (tmp_path / header).write_text(attention_cpu.SOURCE.with_name(header).read_text())
    for source in SOURCES:
        unit = tmp_path / source.name
        text = source.read_text()
        if source == attention_cpu.SOURCE:
            text += CHECKS[TARGETS[march]]
        unit.write_text(text)
        result = subprocess.run(
            [compiler, *flags, "-fsyntax-only", str(unit)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{source.name} for -march={march}:\n{result.stderr}"
