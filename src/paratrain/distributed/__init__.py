"""The free functions that apply one parallel technique each to a model over a ``DeviceMesh``: the mesh itself,
tensor parallelism, consolidated state dicts. Strategies (:mod:`paratrain.strategies`) are presets over them."""
