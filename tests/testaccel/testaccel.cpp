// A multi-device torch device type for the test suite, on the PrivateUse1 dispatch key
// (renamed "testaccel" from Python). Its memory is host memory, its kernels are the CPU
// kernels (a few of its own, a boxed CPU fallback for the rest), its streams and events
// complete at once. It has N devices (NOTEBOOK_ACCEL_TEST_DEVICES, default 4), each with
// its own allocator statistics, nominal total memory (NOTEBOOK_ACCEL_TEST_DEVICE_MEMORY
// bytes, default 8 GiB) and default random generator.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/is_set_to_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <pthread.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace testaccel {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

constexpr DeviceType kType = DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;
constexpr size_t kAlignment = 64;

int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    return fallback;
  }
  return std::stoll(value);
}

DeviceIndex device_count() {
  static const DeviceIndex count = [] {
    int64_t n = env_int("NOTEBOOK_ACCEL_TEST_DEVICES", 4);
    TORCH_CHECK(
        n >= 1 && n <= kMaxDevices,
        "NOTEBOOK_ACCEL_TEST_DEVICES must be between 1 and ",
        kMaxDevices,
        ", got ",
        n);
    return static_cast<DeviceIndex>(n);
  }();
  return count;
}

size_t device_total_memory() {
  static const size_t total = static_cast<size_t>(
      env_int("NOTEBOOK_ACCEL_TEST_DEVICE_MEMORY", int64_t(8) << 30));
  return total;
}

void check_index(DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < device_count(),
      "invalid testaccel device index ",
      static_cast<int>(index),
      " (there are ",
      static_cast<int>(device_count()),
      " devices)");
}

// ---------------------------------------------------------------------------
// Initialisation, as a real device's runtime has it: started by the first
// allocation or set_device, and unusable in a child forked after that (as CUDA
// is), so that the suite exercises the launcher's clean-process path.

std::atomic<bool> initialized{false};
std::atomic<bool> in_bad_fork{false};

void mark_child_of_initialized_parent() {
  if (initialized.load()) {
    in_bad_fork.store(true);
    initialized.store(false);
  }
}

void lazy_init() {
  TORCH_CHECK(
      !in_bad_fork.load(),
      "testaccel: cannot use a testaccel device in a forked subprocess once its parent "
      "has: start the process clean (the 'spawn' or 'forkserver' start method)");
  if (!initialized.exchange(true)) {
    static const int registered =
        pthread_atfork(nullptr, nullptr, &mark_child_of_initialized_parent);
    (void)registered;
  }
}

// ---------------------------------------------------------------------------
// Current device and streams, per thread.

thread_local DeviceIndex current_device = 0;
thread_local std::array<c10::StreamId, kMaxDevices> current_streams{};
std::atomic<c10::StreamId> next_stream_id{1};

DeviceIndex resolve(DeviceIndex index) {
  return index < 0 ? current_device : index;
}

struct TimedEvent {
  std::chrono::steady_clock::time_point when;
};

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override {
    return kType;
  }
  Device exchangeDevice(Device device) const override {
    Device old = getDevice();
    if (device.index() != current_device) {
      setDevice(device);
    }
    return old;
  }
  Device getDevice() const override {
    return Device(kType, current_device);
  }
  void setDevice(Device device) const override {
    TORCH_CHECK(device.type() == kType, "expected a testaccel device, got ", device);
    check_index(device.index());
    lazy_init();
    current_device = device.index();
  }
  void uncheckedSetDevice(Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < device_count()) {
      current_device = device.index();
    }
  }
  Stream getStream(Device device) const override {
    DeviceIndex index = resolve(device.index());
    return Stream(Stream::UNSAFE, Device(kType, index), current_streams[index]);
  }
  Stream getDefaultStream(Device device) const override {
    return Stream(Stream::DEFAULT, Device(kType, resolve(device.index())));
  }
  Stream getStreamFromGlobalPool(Device device, bool /*high_priority*/)
      const override {
    return getNewStream(device, 0);
  }
  Stream getNewStream(Device device, int /*priority*/) const override {
    return Stream(
        Stream::UNSAFE, Device(kType, resolve(device.index())), next_stream_id++);
  }
  Stream exchangeStream(Stream stream) const override {
    DeviceIndex index = resolve(stream.device_index());
    Stream old = getStream(Device(kType, index));
    current_streams[index] = stream.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }
  void record(
      void** event,
      const Stream& /*stream*/,
      const DeviceIndex /*device_index*/,
      const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) {
      *event = new TimedEvent();
    }
    static_cast<TimedEvent*>(*event)->when = std::chrono::steady_clock::now();
  }
  void destroyEvent(void* event, const DeviceIndex /*device_index*/)
      const noexcept override {
    delete static_cast<TimedEvent*>(event);
  }
  void block(void* /*event*/, const Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override {
    return true;
  }
  bool queryStream(const Stream& /*stream*/) const override {
    return true;
  }
  void synchronizeStream(const Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const DeviceIndex /*device_index*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const Stream& /*stream*/)
      const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex /*device_index*/)
      const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "both events must be recorded");
    auto from = static_cast<TimedEvent*>(start)->when;
    auto to = static_cast<TimedEvent*>(end)->when;
    return std::chrono::duration<double, std::milli>(to - from).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---------------------------------------------------------------------------
// Memory: host memory, with statistics per device.

using c10::CachingAllocator::Stat;
using c10::CachingDeviceAllocator::DeviceStats;

void delete_block(void* ptr);

// Host memory for `nbytes`, rounded up to whole aligned blocks; `what` names it in
// the out-of-memory error.
void* aligned_host_memory(size_t nbytes, const std::string& what) {
  void* ptr = nullptr;
  size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  TORCH_CHECK_WITH(
      OutOfMemoryError,
      posix_memalign(&ptr, kAlignment, rounded) == 0,
      "testaccel: could not allocate ",
      nbytes,
      " ",
      what);
  return ptr;
}

struct Allocator final : public c10::DeviceAllocator {
  std::mutex mutex;
  std::unordered_map<void*, std::pair<size_t, DeviceIndex>> blocks;
  std::array<DeviceStats, kMaxDevices> stats{};

  c10::DataPtr allocate(size_t nbytes) override {
    DeviceIndex index = current_device;
    check_index(index);
    lazy_init();
    Device device(kType, index);
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, nullptr, &delete_block, device);
    }
    void* ptr = aligned_host_memory(
        nbytes, "bytes on device " + std::to_string(static_cast<int>(index)));
    {
      std::lock_guard<std::mutex> lock(mutex);
      blocks.emplace(ptr, std::make_pair(nbytes, index));
      update(index, nbytes, true);
    }
    return c10::DataPtr(ptr, ptr, &delete_block, device);
  }

  void update(DeviceIndex index, size_t nbytes, bool grow) {
    DeviceStats& s = stats[index];
    constexpr size_t agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    for (Stat* stat :
         {&s.allocated_bytes[agg],
          &s.reserved_bytes[agg],
          &s.active_bytes[agg],
          &s.requested_bytes[agg]}) {
      grow ? stat->increase(nbytes) : stat->decrease(nbytes);
    }
    for (Stat* stat : {&s.allocation[agg], &s.segment[agg], &s.active[agg]}) {
      grow ? stat->increase(1) : stat->decrease(1);
    }
    grow ? ++s.num_device_alloc : ++s.num_device_free;
  }

  void release(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto found = blocks.find(ptr);
      if (found != blocks.end()) {
        update(found->second.second, found->second.first, false);
        blocks.erase(found);
      }
    }
    std::free(ptr);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_block;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {}
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}

  DeviceStats getDeviceStats(DeviceIndex device) override {
    DeviceIndex index = resolve(device);
    check_index(index);
    std::lock_guard<std::mutex> lock(mutex);
    return stats[index];
  }

  template <typename F>
  void each_stat(DeviceIndex index, F f) {
    DeviceStats& s = stats[index];
    for (auto* array :
         {&s.allocation,
          &s.segment,
          &s.active,
          &s.inactive_split,
          &s.allocated_bytes,
          &s.reserved_bytes,
          &s.active_bytes,
          &s.inactive_split_bytes,
          &s.requested_bytes}) {
      for (Stat& stat : *array) {
        f(stat);
      }
    }
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    DeviceIndex index = resolve(device);
    check_index(index);
    std::lock_guard<std::mutex> lock(mutex);
    each_stat(index, [](Stat& stat) { stat.reset_accumulated(); });
    stats[index].num_alloc_retries = 0;
    stats[index].num_ooms = 0;
    stats[index].num_device_alloc = 0;
    stats[index].num_device_free = 0;
  }

  void resetPeakStats(DeviceIndex device) override {
    DeviceIndex index = resolve(device);
    check_index(index);
    std::lock_guard<std::mutex> lock(mutex);
    each_stat(index, [](Stat& stat) { stat.reset_peak(); });
  }

  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    DeviceIndex index = resolve(device);
    check_index(index);
    std::lock_guard<std::mutex> lock(mutex);
    size_t total = device_total_memory();
    auto used = static_cast<size_t>(stats[index].reserved_bytes[0].current);
    return {used >= total ? 0 : total - used, total};
  }

  bool device_of(void* ptr, DeviceIndex* index) {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = blocks.find(ptr);
    if (found == blocks.end()) {
      return false;
    }
    *index = found->second.second;
    return true;
  }
};

Allocator allocator;

void delete_block(void* ptr) {
  allocator.release(ptr);
}

REGISTER_ALLOCATOR(kType, &allocator);

// Page-locked host memory, as far as torch can tell: host memory whose blocks are
// remembered, so that `is_pinned()` answers true for them.
void delete_pinned(void* ptr);

struct PinnedAllocator final : public c10::Allocator {
  std::mutex mutex;
  std::unordered_set<const void*> blocks;

  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes > 0) {
      ptr = aligned_host_memory(nbytes, "pinned bytes");
      std::lock_guard<std::mutex> lock(mutex);
      blocks.insert(ptr);
    }
    return c10::DataPtr(ptr, ptr, &delete_pinned, Device(DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool contains(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex);
    return blocks.count(ptr) > 0;
  }
  void release(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      blocks.erase(ptr);
    }
    std::free(ptr);
  }
};

PinnedAllocator pinned_allocator;

void delete_pinned(void* ptr) {
  pinned_allocator.release(ptr);
}

// ---------------------------------------------------------------------------
// Random numbers: each device's generator wraps a CPU generator, which the CPU
// kernels behind the fallback draw from.

struct Generator final : public c10::GeneratorImpl {
  at::Generator cpu;

  Generator(DeviceIndex index, uint64_t seed)
      : c10::GeneratorImpl(Device(kType, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::detail::createCPUGenerator(seed)) {}

  void set_current_seed(uint64_t seed) override {
    cpu.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    cpu.set_offset(offset);
  }
  uint64_t get_offset() const override {
    return cpu.get_offset();
  }
  uint64_t current_seed() const override {
    return cpu.current_seed();
  }
  uint64_t seed() override {
    return cpu.seed();
  }
  void set_state(const c10::TensorImpl& state) override {
    cpu.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  static DeviceType device_type() {
    return kType;
  }

 private:
  Generator* clone_impl() const override {
    auto* copy = new Generator(device().index(), c10::default_rng_seed_val);
    copy->cpu = cpu.clone();
    return copy;
  }
};

at::Generator make_generator(DeviceIndex index) {
  return at::make_generator<Generator>(resolve(index), c10::default_rng_seed_val);
}

const at::Generator& default_generator(DeviceIndex device) {
  static std::vector<at::Generator> generators = [] {
    std::vector<at::Generator> made;
    for (DeviceIndex i = 0; i < device_count(); ++i) {
      made.push_back(make_generator(i));
    }
    return made;
  }();
  DeviceIndex index = resolve(device);
  check_index(index);
  return generators[index];
}

// ---------------------------------------------------------------------------
// Hooks: what torch asks of an accelerator.

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  const at::Generator& getDefaultGenerator(DeviceIndex device_index) const override {
    return default_generator(device_index);
  }
  at::Generator getNewGenerator(DeviceIndex device_index) const override {
    return make_generator(device_index);
  }
  Device getDeviceFromPtr(void* data) const override {
    DeviceIndex index = current_device;
    allocator.device_of(data, &index);
    return Device(kType, index);
  }
  bool isPinnedPtr(const void* data) const override {
    return pinned_allocator.contains(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &pinned_allocator;
  }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override {
    return true;
  }
  void init() const override {}
  DeviceIndex deviceCount() const override {
    return device_count();
  }
  void setCurrentDevice(DeviceIndex device) const override {
    check_index(device);
    current_device = device;
  }
  DeviceIndex getCurrentDevice() const override {
    return current_device;
  }
  DeviceIndex exchangeDevice(DeviceIndex device) const override {
    DeviceIndex old = current_device;
    setCurrentDevice(device);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize)
      const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    c10::DeviceGuard guard(impl->device());
    c10::DataPtr fresh = allocator.allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0 && impl->data() != nullptr) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// ---------------------------------------------------------------------------
// Kernels of its own.

DeviceIndex index_of(std::optional<Device> device) {
  if (device.has_value() && device->has_index()) {
    return device->index();
  }
  return current_device;
}

at::Tensor empty(
    at::IntArrayRef size,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout> /*layout*/,
    std::optional<Device> device,
    std::optional<bool> /*pin_memory*/,
    std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(Device(kType, index_of(device)));
  return at::detail::empty_generic(
      size,
      &allocator,
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype),
      memory_format);
}

at::Tensor empty_strided(
    at::IntArrayRef size,
    at::IntArrayRef stride,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout> /*layout*/,
    std::optional<Device> device,
    std::optional<bool> /*pin_memory*/) {
  c10::DeviceGuard guard(Device(kType, index_of(device)));
  return at::detail::empty_strided_generic(
      size,
      stride,
      &allocator,
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

// A CPU tensor over the same memory: the device's memory is host memory.
at::Tensor on_host(const at::Tensor& tensor) {
  if (tensor.device().is_cpu()) {
    return tensor;
  }
  TORCH_CHECK(
      tensor.device().type() == kType,
      "testaccel cannot copy from or to a tensor on ",
      tensor.device());
  at::Tensor host = at::from_blob(
      tensor.data_ptr(),
      tensor.sizes(),
      tensor.strides(),
      tensor.options().device(at::kCPU));
  if (tensor.is_conj()) {
    host = host.conj();
  }
  if (tensor.is_neg()) {
    host = host._neg_view();
  }
  return host;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  if (self.numel() == 0 || dst.numel() == 0) {
    return dst;
  }
  on_host(dst).copy_(on_host(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  return at::_local_scalar_dense(on_host(self));
}

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& value) {
  if (self.numel() > 0) {
    on_host(self).fill_(value);
  }
  return self;
}

at::Tensor& zero(at::Tensor& self) {
  if (self.numel() > 0) {
    on_host(self).zero_();
  }
  return self;
}

const at::Tensor& resize(
    const at::Tensor& self,
    at::IntArrayRef size,
    std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, size, memory_format);
}

at::Tensor& set_storage(
    at::Tensor& self,
    at::Storage source,
    int64_t storage_offset,
    at::IntArrayRef size,
    at::IntArrayRef stride) {
  c10::DeviceGuard guard(source.device());
  return at::native::set_storage_cpu_(self, std::move(source), storage_offset, size, stride);
}

at::Tensor& set_whole_storage(at::Tensor& self, at::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  at::Storage storage(at::Storage::use_byte_size_t(), 0, &allocator, true);
  return set_storage(self, std::move(storage), 0, {0}, {});
}

void record_stream(at::Tensor& /*self*/, Stream /*stream*/) {}

// Dropout that draws from the device's generator (the CPU kernel would draw from the
// CPU's default generator).
std::tuple<at::Tensor, at::Tensor> native_dropout(
    const at::Tensor& input,
    double p,
    std::optional<bool> train) {
  if (!train.has_value() || *train) {
    double keep = 1 - p;
    at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
    mask.bernoulli_(keep);
    double scale = keep == 0 ? 0.0 : 1.0 / keep;
    return {input.mul(mask).mul_(scale), mask};
  }
  return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
}

// mse_loss: torch's generic structured kernel hands the fallback an output of the
// unreduced shape, which the CPU kernel then resizes with a deprecation warning.
at::Tensor mse_loss(const at::Tensor& input, const at::Tensor& target, int64_t reduction) {
  at::Tensor loss = at::mse_loss(on_host(input), on_host(target), reduction);
  return loss.to(input.device());
}

// Everything else: the CPU kernel, on copies. An operator's random generator (none
// given: the device's default one) is handed to the CPU kernel as its CPU generator.
bool is_generator(const c10::Argument& argument) {
  c10::TypePtr type = argument.type();
  if (auto optional = type->cast<c10::OptionalType>()) {
    type = optional->getElementType();
  }
  return type->kind() == c10::TypeKind::GeneratorType;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  bool has_generator = false;
  DeviceIndex index = -1;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    has_generator = has_generator || is_generator(arguments[i]);
    if (index < 0 && value.isTensor() && value.toTensor().defined() &&
        value.toTensor().device().type() == kType) {
      index = value.toTensor().device().index();
    }
    if (index < 0 && value.isTensorList()) {
      for (const at::Tensor& tensor : value.toTensorList().vec()) {
        if (tensor.defined() && tensor.device().type() == kType) {
          index = tensor.device().index();
          break;
        }
      }
    }
  }
  if (has_generator) {
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (!is_generator(arguments[i])) {
        continue;
      }
      c10::IValue& value = (*stack)[first + i];
      at::Generator generator = value.isNone()
          ? default_generator(index)
          : value.toGenerator();
      if (generator.device().type() == kType) {
        auto* impl = static_cast<Generator*>(generator.unsafeGetGeneratorImpl());
        value = c10::IValue(impl->cpu);
      }
    }
  }
  at::native::cpu_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("is_set_to", TORCH_FN(at::native::is_set_to));
  m.impl("resize_", TORCH_FN(resize));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  m.impl("set_.source_Storage", TORCH_FN(set_whole_storage));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("fill_.Scalar", TORCH_FN(fill_scalar));
  m.impl("zero_", TORCH_FN(zero));
  m.impl("record_stream", TORCH_FN(record_stream));
  m.impl("native_dropout", TORCH_FN(native_dropout));
  m.impl("mse_loss", TORCH_FN(mse_loss));
}

// ---------------------------------------------------------------------------
// Autocast: torch registers no autocast kernels for PrivateUse1; these follow the lists
// torch uses for its own devices, casting to at::autocast::get_autocast_dtype.

#define TESTACCEL_LOWER_PRECISION(...) \
  KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TESTACCEL_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TESTACCEL_FP32_SET_OPT_DTYPE(...) \
  KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TESTACCEL_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  using at::autocast::CastPolicy;
  AT_FORALL_LOWER_PRECISION_FP(TESTACCEL_LOWER_PRECISION)
  AT_FORALL_FP32(TESTACCEL_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TESTACCEL_FP32_SET_OPT_DTYPE)
  AT_FORALL_PROMOTE(TESTACCEL_PROMOTE)
}

// ---------------------------------------------------------------------------
// The numbers, for Python: torch.ops.testaccel.*

std::vector<int64_t> memory_stats(int64_t device) {
  DeviceStats s = allocator.getDeviceStats(static_cast<DeviceIndex>(device));
  return {
      s.allocated_bytes[0].current,
      s.allocated_bytes[0].peak,
      s.reserved_bytes[0].current,
      s.reserved_bytes[0].peak,
      s.allocation[0].allocated,
      s.allocation[0].freed,
      static_cast<int64_t>(device_total_memory()),
  };
}

void reset_peak_memory_stats(int64_t device) {
  allocator.resetPeakStats(static_cast<DeviceIndex>(device));
}

void reset_accumulated_memory_stats(int64_t device) {
  allocator.resetAccumulatedStats(static_cast<DeviceIndex>(device));
}

int64_t device_count_op() {
  return device_count();
}

int64_t current_device_op() {
  return current_device;
}

void set_device_op(int64_t device) {
  check_index(static_cast<DeviceIndex>(device));
  lazy_init();
  current_device = static_cast<DeviceIndex>(device);
}

at::Generator default_generator_op(int64_t device) {
  return default_generator(static_cast<DeviceIndex>(device));
}

bool is_initialized_op() {
  return initialized.load();
}

bool is_in_bad_fork_op() {
  return in_bad_fork.load();
}

TORCH_LIBRARY(testaccel, m) {
  m.def("is_initialized() -> bool", &is_initialized_op);
  m.def("is_in_bad_fork() -> bool", &is_in_bad_fork_op);
  m.def("default_generator(int device) -> Generator?", &default_generator_op);
  m.def("memory_stats(int device) -> int[]", &memory_stats);
  m.def("reset_peak_memory_stats(int device) -> ()", &reset_peak_memory_stats);
  m.def(
      "reset_accumulated_memory_stats(int device) -> ()",
      &reset_accumulated_memory_stats);
  m.def("device_count() -> int", &device_count_op);
  m.def("current_device() -> int", &current_device_op);
  m.def("set_device(int device) -> ()", &set_device_op);
}

} // namespace testaccel
