"""The Sparse DNN Graph Challenge (HPEC 2019-2020): network generator, TSV files, reference inference, runs."""
