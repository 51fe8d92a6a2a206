// One error style for every optstate library: Status for operations without a value, Result<T> for
// operations that produce one. Only cli/ turns these into exit codes.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace optstate {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,  // caller passed something unusable (bad option, bad shape)
  kNotFound,         // a path, entry or parameter that does not exist
  kIoError,          // the operating system refused a read/write/rename/fsync
  kCorrupt,          // a file exists but its bytes are wrong (magic, sizes, checksums, JSON)
  kUnsupported,      // valid but newer/other than what this build understands
  kInternal,
  kCancelled,        // stopped on request (a signal) before it finished; nothing was published
};

const char* error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "corrupt: <message>"; an ok status prints "ok".
  std::string to_string() const;
  // Prefixes context ("reading ckpt/data/rank-00000.bin: ") to a failed status; ok stays ok.
  Status with_context(const std::string& context) const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

Status invalid_argument(std::string message);
Status not_found(std::string message);
Status io_error(std::string message);
Status corrupt(std::string message);
Status unsupported(std::string message);
Status internal_error(std::string message);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design, like absl::StatusOr
  Result(Status status) : v_(std::move(status)) {
    if (std::get<Status>(v_).ok()) v_ = Status(ErrorCode::kInternal, "Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace optstate

#define OPTSTATE_CONCAT_INNER(a, b) a##b
#define OPTSTATE_CONCAT(a, b) OPTSTATE_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when it is not ok.
#define OPTSTATE_RETURN_IF_ERROR(expr)              \
  do {                                              \
    ::optstate::Status _optstate_st = (expr);       \
    if (!_optstate_st.ok()) return _optstate_st;    \
  } while (0)

#define OPTSTATE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

// OPTSTATE_ASSIGN_OR_RETURN(auto x, f()); returns f()'s status when it failed.
#define OPTSTATE_ASSIGN_OR_RETURN(lhs, expr) \
  OPTSTATE_ASSIGN_OR_RETURN_IMPL(OPTSTATE_CONCAT(_optstate_res_, __LINE__), lhs, expr)
