"""Writes h5py_paged_committed.h5 from h5py_edited.h5 (run from this folder, h5py installed): every
group and dataset copied into libver='v110' with paged file space aggregation and persistent free
space (a file space info message in the superblock extension, which H5Fopen decodes), the float32
datasets of a committed datatype (each one's datatype a shared message naming its object header)
and a root attribute of another, and more root attributes than compact storage holds, one of them
a huge object of its fractal heap (past 4 KiB), so that fuzz_hdf5_file mutates what the driver
checks before H5Fopen, where shared messages lead, and huge objects."""
import h5py
import numpy as np

with h5py.File("h5py_edited.h5", "r") as src, \
        h5py.File("h5py_paged_committed.h5", "w", libver="v110", fs_strategy="page", fs_persist=True,
                  fs_page_size=512) as dst:
    dst["f32"] = np.dtype("<f4")
    dst["i32"] = np.dtype("<i4")

    def copy_attrs(a, b):
        for k, v in a.attrs.items():
            b.attrs[k] = v.decode() if isinstance(v, bytes) else v

    def visit(name, obj):
        if isinstance(obj, h5py.Group):
            copy_attrs(obj, dst.require_group(name))
            return
        dtype = dst["f32"] if obj.dtype == np.float32 else obj.dtype
        copy_attrs(obj, dst.create_dataset(name, data=obj[...], dtype=dtype, chunks=obj.chunks,
                                           fletcher32=obj.fletcher32))

    copy_attrs(src, dst)
    src.visititems(visit)
    dst.attrs.create("epoch", 7, dtype=dst["i32"])
    for i in range(8):
        dst.attrs[f"note{i}"] = f"a note {i}"
    dst.attrs["curve"] = np.linspace(0, 1, 1500, dtype=np.float32)
