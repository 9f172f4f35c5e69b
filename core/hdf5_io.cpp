// HDF5 result files through the HDF5 C API: datasets from CPU tensors (intermediate groups created),
// string attributes on the root, a temporary file renamed on commit; and read() back into tensors.
#include "core/hdf5_io.h"

#include <ATen/ATen.h>
#include <hdf5.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"

namespace kiln::hdf5 {

namespace {

// Our messages replace HDF5's own stack dumps on stderr.
// Before HDF5's first use: no automatic error printing, and no atexit handler. Every file kiln
// opens is closed explicitly; after a close that failed (a full disk) HDF5 keeps the file half
// open, and its atexit handler then crashed retrying the flush (exit 139 after the right error).
void quiet() {
  static const bool once = [] { return H5dont_atexit() >= 0; }();
  (void)once;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

// The most specific message on HDF5's error stack, then clears it.
std::string hdf5_error() {
  std::string out;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD,
           [](unsigned n, const H5E_error2_t* err, void* data) -> herr_t {
             auto* s = static_cast<std::string*>(data);
             if (n == 0 && err && err->desc) *s = err->desc;
             return 0;
           },
           &out);
  H5Eclear2(H5E_DEFAULT);
  for (char& c : out)
    if (c == '\n') c = ' ';  // one line: some HDF5 messages carry newlines
  return out.empty() ? std::string("unknown") : out;
}

// Closes an HDF5 handle when it goes out of scope.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() {
    if (id_ >= 0) close_(id_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }
  void reset(hid_t id) {
    if (id_ >= 0) close_(id_);
    id_ = id;
  }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// IEEE 754 half, built the way h5py builds it (HDF5 1.10 has no predefined 16-bit float).
hid_t make_half_type() {
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  if (t < 0) return t;
  if (H5Tset_fields(t, 15, 10, 5, 0, 10) < 0 || H5Tset_size(t, 2) < 0 || H5Tset_ebias(t, 15) < 0) {
    H5Tclose(t);
    return -1;
  }
  return t;
}

// The file and memory types for a tensor dtype; `converted` is the dtype the bytes are written in.
struct TypeMap {
  hid_t file_type;     // predefined, or owned (half) when `owned`
  hid_t memory_type;
  at::ScalarType converted;
  bool owned = false;
};

}  // namespace

Writer::Writer(const std::string& path) : path_(path) {
  quiet();
  const std::string tmp = path + ".tmp";
  hid_t f = H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  KILN_CHECK(f >= 0, "hdf5: cannot create file (file=", tmp, ", hdf5=", hdf5_error(),
             "); check that the directory exists and is writable");
  file_ = f;
}

Writer::~Writer() {
  if (file_ < 0) return;
  H5Fclose(static_cast<hid_t>(file_));
  H5Eclear2(H5E_DEFAULT);
  file_ = -1;
  std::remove((path_ + ".tmp").c_str());
}

void Writer::write(const std::string& name, const at::Tensor& tensor) {
  quiet();
  KILN_CHECK(file_ >= 0, "hdf5: write after commit (file=", path_, ", dataset=", name,
             "); write every dataset before commit()");
  KILN_CHECK(tensor.defined(), "hdf5: undefined tensor (file=", path_, ", dataset=", name,
             "); pass a defined tensor");
  TypeMap tm{};
  switch (tensor.scalar_type()) {
    case at::kBool: tm = {H5T_STD_U8LE, H5T_NATIVE_UINT8, at::kByte}; break;
    case at::kByte: tm = {H5T_STD_U8LE, H5T_NATIVE_UINT8, at::kByte}; break;
    case at::kChar: tm = {H5T_STD_I8LE, H5T_NATIVE_INT8, at::kChar}; break;
    case at::kShort: tm = {H5T_STD_I16LE, H5T_NATIVE_INT16, at::kShort}; break;
    case at::kInt: tm = {H5T_STD_I32LE, H5T_NATIVE_INT32, at::kInt}; break;
    case at::kLong: tm = {H5T_STD_I64LE, H5T_NATIVE_INT64, at::kLong}; break;
    case at::kHalf: {
      hid_t half = make_half_type();
      KILN_CHECK(half >= 0, "hdf5: cannot build the float16 type (file=", path_, ", dataset=", name,
                 ", hdf5=", hdf5_error(), "); write the tensor as float32");
      tm = {half, half, at::kHalf, true};
      break;
    }
    case at::kBFloat16: tm = {H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, at::kFloat}; break;
    case at::kFloat: tm = {H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, at::kFloat}; break;
    case at::kDouble: tm = {H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, at::kDouble}; break;
    default:
      KILN_FAIL("hdf5: unsupported tensor dtype (file=", path_, ", dataset=", name, ", dtype=",
                tensor.scalar_type(), "); convert to bool, uint8, int8/16/32/64, float16, bfloat16, ",
                "float32 or float64");
  }
  Handle owned_type(tm.owned ? tm.file_type : -1, H5Tclose);

  at::Tensor cpu = tensor.detach().to(at::kCPU, tm.converted).contiguous();
  std::vector<hsize_t> dims(cpu.sizes().begin(), cpu.sizes().end());
  Handle space(cpu.dim() == 0 ? H5Screate(H5S_SCALAR)
                              : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
               H5Sclose);
  KILN_CHECK(space.ok(), "hdf5: cannot create the dataspace (file=", path_, ", dataset=", name,
             ", shape=", cpu.sizes(), ", hdf5=", hdf5_error(), "); check the tensor shape");
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  KILN_CHECK(lcpl.ok() && H5Pset_create_intermediate_group(lcpl.get(), 1) >= 0,
             "hdf5: cannot set up link creation (file=", path_, ", dataset=", name,
             ", hdf5=", hdf5_error(), "); this is an HDF5 installation problem");
  Handle dset(H5Dcreate2(static_cast<hid_t>(file_), name.c_str(), tm.file_type, space.get(),
                         lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
              H5Dclose);
  KILN_CHECK(dset.ok(), "hdf5: cannot create dataset (file=", path_, ", dataset=", name,
             ", hdf5=", hdf5_error(), "); the name may already exist or clash with a dataset");
  if (cpu.numel() > 0) {
    KILN_CHECK(H5Dwrite(dset.get(), tm.memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, cpu.data_ptr()) >= 0,
               "hdf5: cannot write dataset (file=", path_, ", dataset=", name, ", hdf5=",
               hdf5_error(), "); check free disk space");
  }
}

void Writer::attribute(const std::string& name, const std::string& value) {
  quiet();
  KILN_CHECK(file_ >= 0, "hdf5: attribute after commit (file=", path_, ", attribute=", name,
             "); write every attribute before commit()");
  const hid_t file = static_cast<hid_t>(file_);
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  KILN_CHECK(type.ok() && H5Tset_size(type.get(), H5T_VARIABLE) >= 0 &&
                 H5Tset_cset(type.get(), H5T_CSET_UTF8) >= 0,
             "hdf5: cannot build the string type (file=", path_, ", attribute=", name,
             ", hdf5=", hdf5_error(), "); this is an HDF5 installation problem");
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  KILN_CHECK(space.ok(), "hdf5: cannot create a scalar dataspace (file=", path_, ", attribute=", name,
             ", hdf5=", hdf5_error(), "); this is an HDF5 installation problem");
  htri_t exists = H5Aexists(file, name.c_str());
  KILN_CHECK(exists >= 0, "hdf5: cannot query attribute (file=", path_, ", attribute=", name,
             ", hdf5=", hdf5_error(), "); check the attribute name");
  if (exists > 0) {  // the last value written wins
    KILN_CHECK(H5Adelete(file, name.c_str()) >= 0, "hdf5: cannot replace attribute (file=", path_,
               ", attribute=", name, ", hdf5=", hdf5_error(), "); write each attribute once");
  }
  Handle attr(H5Acreate2(file, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
              H5Aclose);
  KILN_CHECK(attr.ok(), "hdf5: cannot create attribute (file=", path_, ", attribute=", name,
             ", hdf5=", hdf5_error(), "); check the attribute name");
  const char* text = value.c_str();
  KILN_CHECK(H5Awrite(attr.get(), type.get(), &text) >= 0, "hdf5: cannot write attribute (file=",
             path_, ", attribute=", name, ", hdf5=", hdf5_error(), "); check free disk space");
}

void Writer::commit() {
  quiet();
  KILN_CHECK(file_ >= 0, "hdf5: commit called twice (file=", path_, "); call commit() once");
  const std::string tmp = path_ + ".tmp";
  herr_t closed = H5Fclose(static_cast<hid_t>(file_));
  file_ = -1;
  if (closed < 0) {
    std::string why = hdf5_error();
    std::remove(tmp.c_str());
    KILN_FAIL("hdf5: cannot close file (file=", tmp, ", hdf5=", why, "); check free disk space");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  if (ec) {
    std::remove(tmp.c_str());
    KILN_FAIL("hdf5: cannot rename the temporary file into place (file=", path_, ", temp=", tmp,
              ", error=", ec.message(), "); check the directory permissions");
  }
}

at::Tensor read(const std::string& path, const std::string& name) {
  quiet();
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  KILN_CHECK(file.ok(), "hdf5: cannot open file (file=", path, ", hdf5=", hdf5_error(),
             "); check that the path exists and is an HDF5 file");
  Handle dset(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
  KILN_CHECK(dset.ok(), "hdf5: no such dataset (file=", path, ", dataset=", name, ", hdf5=",
             hdf5_error(), "); check the dataset name (h5ls -r lists them)");
  Handle ftype(H5Dget_type(dset.get()), H5Tclose);
  KILN_CHECK(ftype.ok(), "hdf5: cannot get the dataset type (file=", path, ", dataset=", name,
             ", hdf5=", hdf5_error(), "); the file may be corrupt");
  const H5T_class_t cls = H5Tget_class(ftype.get());
  const size_t size = H5Tget_size(ftype.get());
  const bool is_signed = cls == H5T_INTEGER && H5Tget_sign(ftype.get()) == H5T_SGN_2;

  at::ScalarType dtype = at::kByte;
  hid_t memory_type = -1;
  Handle owned_type(-1, H5Tclose);
  if (cls == H5T_INTEGER && size == 1) {
    dtype = is_signed ? at::kChar : at::kByte;
    memory_type = is_signed ? H5T_NATIVE_INT8 : H5T_NATIVE_UINT8;
  } else if (cls == H5T_INTEGER && size == 2 && is_signed) {
    dtype = at::kShort, memory_type = H5T_NATIVE_INT16;
  } else if (cls == H5T_INTEGER && size == 4 && is_signed) {
    dtype = at::kInt, memory_type = H5T_NATIVE_INT32;
  } else if (cls == H5T_INTEGER && size == 8 && is_signed) {
    dtype = at::kLong, memory_type = H5T_NATIVE_INT64;
  } else if (cls == H5T_INTEGER && (size == 2 || size == 4)) {  // unsigned: widen losslessly
    dtype = size == 2 ? at::kInt : at::kLong;
    memory_type = size == 2 ? H5T_NATIVE_INT32 : H5T_NATIVE_INT64;
  } else if (cls == H5T_FLOAT && size == 2) {
    hid_t half = make_half_type();
    KILN_CHECK(half >= 0, "hdf5: cannot build the float16 type (file=", path, ", dataset=", name,
               ", hdf5=", hdf5_error(), "); this is an HDF5 installation problem");
    owned_type.reset(half);
    dtype = at::kHalf, memory_type = half;
  } else if (cls == H5T_FLOAT && size == 4) {
    dtype = at::kFloat, memory_type = H5T_NATIVE_FLOAT;
  } else if (cls == H5T_FLOAT && size == 8) {
    dtype = at::kDouble, memory_type = H5T_NATIVE_DOUBLE;
  } else if (cls == H5T_ENUM && size == 1) {  // h5py's bool: enum {FALSE=0, TRUE=1} over int8
    dtype = at::kBool, memory_type = ftype.get();
  } else {
    KILN_FAIL("hdf5: unsupported dataset type (file=", path, ", dataset=", name, ", class=",
              static_cast<int>(cls), ", size=", size,
              "); kiln reads integer, float16/32/64 and bool datasets");
  }

  Handle space(H5Dget_space(dset.get()), H5Sclose);
  KILN_CHECK(space.ok(), "hdf5: cannot get the dataspace (file=", path, ", dataset=", name,
             ", hdf5=", hdf5_error(), "); the file may be corrupt");
  const int rank = H5Sget_simple_extent_ndims(space.get());
  KILN_CHECK(rank >= 0, "hdf5: cannot get the dataset rank (file=", path, ", dataset=", name,
             ", hdf5=", hdf5_error(), "); kiln reads simple (array or scalar) datasets");
  std::vector<hsize_t> dims(rank);
  if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  std::vector<int64_t> shape(dims.begin(), dims.end());
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
  if (out.numel() > 0) {
    KILN_CHECK(H5Dread(dset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data_ptr()) >= 0,
               "hdf5: cannot read dataset (file=", path, ", dataset=", name, ", hdf5=",
               hdf5_error(), "); the file may be corrupt");
  }
  return out;
}

}  // namespace kiln::hdf5
