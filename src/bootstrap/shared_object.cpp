#include "bootstrap/shared_object.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace epx {

namespace {

// Rank 0's object name, as every rank receives it ("" where it could not create one).
struct SharedName {
  char text[64];
};

// Maps `name` (creating it, zeroed, when `create`); nullptr on any failure.
void* map_shared(const char* name, size_t bytes, bool create) {
  const int fd = shm_open(name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    shm_unlink(name);
    return nullptr;
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name);
    return nullptr;
  }
  if (create) std::memset(base, 0, bytes);
  return base;
}

}  // namespace

SharedObject::SharedObject(Bootstrap& bootstrap, size_t bytes) : bytes_(bytes) {
  SharedName name{};
  if (bootstrap.rank() == 0) {
    // Unique per process and object: the pid, a steady-clock stamp and a counter.
    static std::atomic<unsigned> counter{0};
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    std::snprintf(name.text, sizeof(name.text), "/epx-%d-%llx-%u", static_cast<int>(getpid()),
                  static_cast<unsigned long long>(now), counter.fetch_add(1));
    base_ = map_shared(name.text, bytes, true);
    owner_ = base_ != nullptr;
    if (base_ == nullptr) name.text[0] = '\0';
  }
  name_ = all_gather_value(bootstrap, name)[0].text;
  if (bootstrap.rank() != 0 && !name_.empty()) base_ = map_shared(name_.c_str(), bytes, false);
}

SharedObject::~SharedObject() {
  unlink();
  release();
}

void SharedObject::unlink() noexcept {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

void SharedObject::release() noexcept {
  if (base_ != nullptr) munmap(base_, bytes_);
  base_ = nullptr;
}

}  // namespace epx
