#include "epx/local_launcher.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>

#include "bootstrap/shm_bootstrap.hpp"
#include "bootstrap/shm_segment.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

using bootstrap::ExitState;
using bootstrap::SharedSegment;
using Clock = std::chrono::steady_clock;

constexpr size_t kMaxGatherBytesLimit = size_t{1} << 30;
constexpr std::chrono::milliseconds kPollInterval{1};

void validate(const LocalLaunchOptions& options) {
  EPX_CHECK(options.num_ranks >= 1, "num_ranks", options.num_ranks, "must be >= 1");
  EPX_CHECK(options.num_ranks <= bootstrap::kMaxRanks, "num_ranks", options.num_ranks, "must be <= 64");
  EPX_CHECK(options.timeout.count() > 0, "timeout_ms", options.timeout.count(), "must be > 0");
  EPX_CHECK(options.max_gather_bytes <= kMaxGatherBytesLimit, "max_gather_bytes", options.max_gather_bytes,
            "must be <= 1 GiB");
  EPX_CHECK(options.kill_grace.count() >= 0, "kill_grace_ms", options.kill_grace.count(), "must be >= 0");
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Runs in the child; never returns. _exit skips the parent's atexit handlers and static destructors
// (GoogleTest's among them), which belong to the parent.
[[noreturn]] void run_child(SharedSegment& segment, int rank, pid_t parent_pid,
                            const LocalLaunchOptions& options, const std::function<int(Bootstrap&)>& worker) {
  // A child orphaned by a dying launcher would otherwise wait out its timeouts holding a GPU.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent_pid) _exit(1);

  bootstrap::RankState& state = segment.header().ranks[rank];
  int exit_code = 1;
  std::string message;
  try {
    bootstrap::ShmBootstrap group(segment, rank, options.timeout);
    const int worker_code = worker(group);
    if (worker_code >= 0 && worker_code <= 255) {
      exit_code = worker_code;
    } else {
      message = detail::concat("worker returned ", worker_code, ", outside the exit code range [0, 255]");
    }
  } catch (const std::exception& error) {
    message = error.what();
  } catch (...) {
    message = "worker threw an exception not derived from std::exception";
  }
  bootstrap::copy_message(state.message, message);
  state.exit_time_ns = now_ns();
  state.exit_state.store(message.empty() ? ExitState::kReturned : ExitState::kFailed,
                         std::memory_order_release);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  _exit(exit_code);
}

struct RankOutcome {
  int rank = -1;
  int exit_code = 0;
  std::string failure;  // empty when the rank succeeded; without the "rank r: " prefix
  // When the rank failed: the child's own stamp when its worker ended, else (signal, _exit) when it was
  // reaped. Peers learn of a failure only after this moment, so sorting by it lists root causes first.
  int64_t failure_time_ns = 0;
};

RankOutcome describe_status(int rank, int status, const bootstrap::RankState& state) {
  RankOutcome outcome;
  outcome.rank = rank;
  if (WIFEXITED(status)) {
    outcome.exit_code = WEXITSTATUS(status);
    if (outcome.exit_code != 0 || state.message[0] != '\0') {
      outcome.failure = detail::concat("exited with code ", outcome.exit_code);
      if (state.message[0] != '\0') outcome.failure += detail::concat(": ", state.message);
    }
  } else if (WIFSIGNALED(status)) {
    const int signal_number = WTERMSIG(status);
    outcome.exit_code = -signal_number;
    outcome.failure = detail::concat("killed by signal ", signal_number, " (", strsignal(signal_number), ")");
  } else {
    outcome.exit_code = -1;
    outcome.failure = detail::concat("ended with unexpected wait status ", status);
  }
  const bool stamped = state.exit_state.load(std::memory_order_acquire) != ExitState::kRunning;
  outcome.failure_time_ns = stamped ? state.exit_time_ns : now_ns();
  return outcome;
}

// Children that have ended since the last call, in the order they failed.
std::vector<RankOutcome> reap_ended(const SharedSegment& segment, std::vector<pid_t>& pids) {
  std::vector<RankOutcome> ended;
  for (int rank = 0; rank < static_cast<int>(pids.size()); ++rank) {
    if (pids[rank] <= 0) continue;
    int status = 0;
    const pid_t reaped = waitpid(pids[rank], &status, WNOHANG);
    if (reaped == 0 || (reaped < 0 && errno == EINTR)) continue;
    pids[rank] = -1;
    if (reaped < 0) {
      ended.push_back(
          {rank, -1, detail::concat("could not be waited for: ", std::strerror(errno)), now_ns()});
    } else {
      ended.push_back(describe_status(rank, status, segment.header().ranks[rank]));
    }
  }
  std::stable_sort(ended.begin(), ended.end(), [](const RankOutcome& a, const RankOutcome& b) {
    return a.failure_time_ns < b.failure_time_ns;
  });
  return ended;
}

// Reaps every child. The first failure aborts the segment (peers blocked in a collective fail with its
// reason); ranks still running kill_grace later are killed.
LocalLaunchResult supervise(SharedSegment& segment, std::vector<pid_t>& pids,
                            const LocalLaunchOptions& options) {
  const int num_ranks = options.num_ranks;
  LocalLaunchResult result;
  result.exit_codes.assign(num_ranks, 0);
  std::vector<bool> killed_by_launcher(num_ranks, false);
  std::vector<RankOutcome> failed;
  std::optional<Clock::time_point> first_failure_time;
  bool kill_sent = false;
  int num_running = num_ranks;

  while (num_running > 0) {
    const std::vector<RankOutcome> ended = reap_ended(segment, pids);
    num_running -= static_cast<int>(ended.size());
    for (RankOutcome outcome : ended) {
      result.exit_codes[outcome.rank] = outcome.exit_code;
      if (outcome.failure.empty()) continue;
      if (killed_by_launcher[outcome.rank] && outcome.exit_code == -SIGKILL) {
        outcome.failure += detail::concat(" by the launcher, ", options.kill_grace.count(), " ms after rank ",
                                          segment.header().abort_rank, " failed");
      }
      if (!first_failure_time) {
        first_failure_time = Clock::now();
        segment.abort(outcome.rank, outcome.failure);
      }
      failed.push_back(std::move(outcome));
    }
    if (first_failure_time && !kill_sent && Clock::now() - *first_failure_time >= options.kill_grace) {
      kill_sent = true;
      for (int rank = 0; rank < num_ranks; ++rank) {
        if (pids[rank] <= 0) continue;
        killed_by_launcher[rank] = true;
        kill(pids[rank], SIGKILL);
      }
    }
    if (ended.empty() && num_running > 0) std::this_thread::sleep_for(kPollInterval);
  }

  // A root cause reaped a poll later than the failure it caused in a peer still goes first.
  std::stable_sort(failed.begin(), failed.end(), [](const RankOutcome& a, const RankOutcome& b) {
    return a.failure_time_ns < b.failure_time_ns;
  });
  for (const RankOutcome& outcome : failed) {
    result.failures.push_back(detail::concat("rank ", outcome.rank, ": ", outcome.failure));
  }
  return result;
}

void kill_and_reap(const std::vector<pid_t>& pids) {
  for (const pid_t pid : pids) {
    if (pid > 0) kill(pid, SIGKILL);
  }
  for (const pid_t pid : pids) {
    if (pid <= 0) continue;
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

}  // namespace

bool LocalLaunchResult::ok() const {
  if (!failures.empty()) return false;
  for (const int exit_code : exit_codes) {
    if (exit_code != 0) return false;
  }
  return true;
}

std::string LocalLaunchResult::summary() const {
  const size_t num_ranks = exit_codes.size();
  if (ok()) return detail::concat("all ", num_ranks, " ranks succeeded");
  std::string text = detail::concat(failures.size(), " of ", num_ranks, " ranks failed:");
  for (const std::string& failure : failures) text += "\n  " + failure;
  return text;
}

LocalLaunchResult launch_local(const LocalLaunchOptions& options,
                               const std::function<int(Bootstrap&)>& worker) {
  validate(options);
  EPX_CHECK(static_cast<bool>(worker), "worker", "empty std::function", "must be callable");
  SharedSegment segment(options.num_ranks, options.max_gather_bytes);

  // Output still buffered in this process would otherwise be written once per child as well.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);

  const pid_t parent_pid = getpid();
  std::vector<pid_t> pids(options.num_ranks, -1);
  for (int rank = 0; rank < options.num_ranks; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) run_child(segment, rank, parent_pid, options, worker);
    if (pid < 0) {
      const int fork_errno = errno;
      kill_and_reap(pids);
      EPX_FAIL("local launcher: fork for rank ", rank, " of ", options.num_ranks,
               " failed: ", std::strerror(fork_errno));
    }
    pids[rank] = pid;
  }
  return supervise(segment, pids, options);
}

}  // namespace epx
