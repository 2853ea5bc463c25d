"""The data layer, Kedro-free: raw records (`records`), image paths and checks (`images`), the split
(`split`), the demo catalogue (`catalogue`) and the typed settings of `data`, `data_processing` and
`rerank` (`params`). The data pipelines are thin nodes over these modules."""
