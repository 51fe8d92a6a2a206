#include "optstate/status.h"

namespace optstate {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kIoError: return "I/O error";
    case ErrorCode::kCorrupt: return "corrupt";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kInternal: return "internal error";
    case ErrorCode::kCancelled: return "cancelled";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(error_code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

Status invalid_argument(std::string m) { return {ErrorCode::kInvalidArgument, std::move(m)}; }
Status not_found(std::string m) { return {ErrorCode::kNotFound, std::move(m)}; }
Status io_error(std::string m) { return {ErrorCode::kIoError, std::move(m)}; }
Status corrupt(std::string m) { return {ErrorCode::kCorrupt, std::move(m)}; }
Status unsupported(std::string m) { return {ErrorCode::kUnsupported, std::move(m)}; }
Status internal_error(std::string m) { return {ErrorCode::kInternal, std::move(m)}; }

}  // namespace optstate
