def run(op_dur: list[float], op_act: list[float],
        edge_src: list[int], edge_dst: list[int], edge_delay: list[float],
        wi_streams: list[list[int]], streams: list[list[int]],
        op_kind: list[int], op_pipeline: list[int], op_stage: list[int], op_mb: list[int],
        op_chunk: list[int], op_foreign: list[bool],
        ranks: list[int], rule: int, with_order: bool,
        ) -> tuple[list[float], list[float], list[float], list[float], list[list[int]] | None,
                   float, float]: ...
def stream_totals(op_dur: list[float], op_act: list[float], streams: list[list[int]],
                  ) -> tuple[list[float], list[float]]: ...
def shifted(ids: list[int], lo: int, hi: int, delta: int) -> list[int]: ...
