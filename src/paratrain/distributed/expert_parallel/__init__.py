"""Expert parallelism: a mixture of experts' routed experts split over groups of data-parallel ranks, tokens sent to
their expert's rank and back (:mod:`.dispatch`), the experts found and wrapped (:mod:`.experts`), laid out as
DTensors and reduced (:mod:`.layout`); :mod:`.part` is what a strategy holds."""
