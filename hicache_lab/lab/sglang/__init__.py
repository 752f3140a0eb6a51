"""SGLang 0.5.23 as the reference: imported on CPU (`cpu`), its own cache answering the lab scheduler's questions
(`cache`), a rank's cache operations recorded (`recording`) and replayed through it (`conformance`), and its
source and bench_multiturn logs beside the lab's (`source`)."""
