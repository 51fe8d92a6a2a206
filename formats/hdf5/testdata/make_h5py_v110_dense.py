"""Writes h5py_v110_dense.h5 from h5py_edited.h5 (run from this folder, h5py installed): every
group and dataset copied into libver='v110' with the datasets resizable, shuffled and gzip-compressed
with a fill value (chunk indexes: an extensible array, a version 2 B-tree), ten more root attributes
and ten empty root groups (attributes and links past 8: dense storage, a fractal heap indexed by a
version 2 B-tree), so that fuzz_hdf5_file mutates what h5py users' files hold beyond optstate's own."""
import h5py
import numpy as np

with h5py.File("h5py_edited.h5", "r") as src, h5py.File("h5py_v110_dense.h5", "w", libver="v110") as dst:
    def copy_attrs(a, b):
        for k, v in a.attrs.items():
            b.attrs[k] = v.decode() if isinstance(v, bytes) else v

    def visit(name, obj):
        if isinstance(obj, h5py.Group):
            copy_attrs(obj, dst.require_group(name))
            return
        extra = {}
        if obj.ndim:
            extra = dict(maxshape=(None,) * obj.ndim if obj.ndim > 1 else (None,), compression="gzip", shuffle=True,
                         fillvalue=obj.dtype.type(0), chunks=obj.chunks or True)
        copy_attrs(obj, dst.create_dataset(name, data=obj[...], fletcher32=obj.fletcher32, **extra))

    copy_attrs(src, dst)
    src.visititems(visit)
    for i in range(10):
        dst.attrs[f"note{i}"] = f"a note {i}"
        dst.create_group(f"extra{i}")
    dst.attrs["ints"] = np.arange(4, dtype=np.int32)
