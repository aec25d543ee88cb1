"""``pagoda bench serve``."""


def add_bench_serve_parser(sub, add_engine_args) -> None:
    pass
