#include "common/etcd_v2_client.h"

#include <curl/curl.h>

#include <sys/socket.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

namespace ddp::detail {
namespace {

using Clock = std::chrono::steady_clock;

// Beyond this a member that accepted the connection but does not answer (partitioned, stopped,
// or a follower holding a write for a leader that died) is given up for the next one; a wait is
// re-issued rather than held longer. Shorter, and a write that is merely slow (a disk busy with
// fsyncs) would be sent twice; longer, and every write during an election waits it out.
constexpr std::chrono::milliseconds kAttemptCap{1000};
constexpr std::chrono::milliseconds kConnectCap{1000};

void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct Reply {
  std::string body;
  std::uint64_t etcd_index = 0;
};

size_t on_body(char* data, size_t size, size_t count, void* user) {
  static_cast<Reply*>(user)->body.append(data, size * count);
  return size * count;
}

size_t on_header(char* data, size_t size, size_t count, void* user) {
  const std::string line(data, size * count);
  const std::string name = "x-etcd-index:";
  if (line.size() > name.size()) {
    std::string head = line.substr(0, name.size());
    std::transform(head.begin(), head.end(), head.begin(), [](unsigned char c) { return std::tolower(c); });
    if (head == name) static_cast<Reply*>(user)->etcd_index = std::strtoull(line.c_str() + name.size(), nullptr, 10);
  }
  return size * count;
}

std::string escape(CURL* curl, const std::string& text) {
  char* escaped = curl_easy_escape(curl, text.data(), static_cast<int>(text.size()));
  std::string result = escaped == nullptr ? "" : escaped;
  curl_free(escaped);
  return result;
}

// A key's path with each segment escaped, '/' kept.
std::string escape_path(CURL* curl, const std::string& key) {
  std::string path;
  std::stringstream segments(key);
  for (std::string segment; std::getline(segments, segment, '/');) {
    if (segment.empty()) continue;
    path += "/" + escape(curl, segment);
  }
  return path.empty() ? "/" : path;
}

EtcdNode node_of(const nlohmann::json& json) {
  EtcdNode node;
  node.key = json.value("key", "");
  node.value = json.value("value", "");
  node.dir = json.value("dir", false);
  node.modified_index = json.value("modifiedIndex", std::uint64_t{0});
  return node;
}

void flatten(const nlohmann::json& json, std::vector<EtcdNode>& out) {
  if (!json.contains("nodes")) return;
  for (const auto& child : json["nodes"]) {
    out.push_back(node_of(child));
    flatten(child, out);
  }
}

std::string millis(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

// The connections a handle keeps alive must not leak into the processes a launcher starts.
curl_socket_t open_close_on_exec(void* /*unused*/, curlsocktype /*purpose*/, struct curl_sockaddr* address) {
  return ::socket(address->family, address->socktype | SOCK_CLOEXEC, address->protocol);
}

}  // namespace

EtcdV2Client::~EtcdV2Client() {
  for (void* handle : idle_handles_) curl_easy_cleanup(static_cast<CURL*>(handle));
}

EtcdV2Client::EtcdV2Client(std::vector<std::string> endpoints, std::chrono::milliseconds request_timeout)
    : request_timeout_(request_timeout) {
  if (endpoints.empty()) throw std::invalid_argument("ddp: an etcd client needs at least one endpoint HOST:PORT");
  for (std::string& endpoint : endpoints) {
    if (endpoint.rfind("http://", 0) != 0 && endpoint.rfind("https://", 0) != 0) endpoint = "http://" + endpoint;
    while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
    endpoints_.push_back(endpoint);
  }
  init_curl_once();
}

std::vector<std::string> EtcdV2Client::parse_endpoints(const std::string& comma_list) {
  std::vector<std::string> endpoints;
  std::stringstream entries(comma_list);
  for (std::string entry; std::getline(entries, entry, ',');) {
    const size_t scheme = entry.find("://");
    const std::string host_port = scheme == std::string::npos ? entry : entry.substr(scheme + 3);
    const size_t colon = host_port.rfind(':');
    if (host_port.empty() || colon == std::string::npos || colon == 0 || colon + 1 == host_port.size()) {
      throw std::invalid_argument("ddp: etcd endpoint '" + entry + "' in '" + comma_list +
                                  "' is not HOST:PORT; list the members as HOST:PORT,HOST:PORT,...");
    }
    endpoints.push_back(entry);
  }
  if (endpoints.empty()) throw std::invalid_argument("ddp: no etcd endpoint in '" + comma_list + "'");
  return endpoints;
}

std::string EtcdV2Client::current_endpoint() const { return endpoints_[preferred_.load() % endpoints_.size()]; }

EtcdResponse EtcdV2Client::request(const std::string& method, const std::string& key, const std::string& query,
                                   const std::string& body, std::chrono::milliseconds timeout, bool is_wait) {
  const Clock::time_point deadline = Clock::now() + timeout;
  // A pooled handle, back to the pool when this request ends however it ends.
  CURL* handle = nullptr;
  {
    std::lock_guard<std::mutex> lock(idle_mutex_);
    if (!idle_handles_.empty()) {
      handle = static_cast<CURL*>(idle_handles_.back());
      idle_handles_.pop_back();
    }
  }
  if (handle == nullptr) handle = curl_easy_init();
  if (handle == nullptr) throw std::runtime_error("ddp: curl_easy_init failed (out of memory?)");
  auto give_back = [this](CURL* h) {
    std::lock_guard<std::mutex> lock(idle_mutex_);
    idle_handles_.push_back(h);
  };
  std::unique_ptr<CURL, decltype(give_back)> curl(handle, give_back);
  const std::string path = "/v2/keys" + escape_path(curl.get(), key) + (query.empty() ? "" : "?" + query);
  // What each member said last, for the error if none answers.
  std::vector<std::string> failures(endpoints_.size());
  const size_t first = preferred_.load();
  std::chrono::milliseconds backoff{20};
  const bool is_write = method != "GET";
  // Whether an earlier attempt of this write may have been applied by a member that never said so.
  bool maybe_applied = false;
  for (size_t attempt = 0;; ++attempt) {
    const size_t index = (first + attempt) % endpoints_.size();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0 && attempt > 0) break;
    const auto budget = std::max(std::chrono::milliseconds(1), std::min(left, kAttemptCap));
    Reply reply;
    curl_easy_reset(curl.get());
    const std::string url = endpoints_[index] + path;
    curl_easy_setopt(curl.get(), CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl.get(), CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl.get(), CURLOPT_OPENSOCKETFUNCTION, open_close_on_exec);
    curl_easy_setopt(curl.get(), CURLOPT_CUSTOMREQUEST, method.c_str());
    curl_easy_setopt(curl.get(), CURLOPT_TIMEOUT_MS, static_cast<long>(budget.count()));
    curl_easy_setopt(curl.get(), CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(std::min(budget, kConnectCap).count()));
    curl_easy_setopt(curl.get(), CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(curl.get(), CURLOPT_WRITEDATA, &reply);
    curl_easy_setopt(curl.get(), CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(curl.get(), CURLOPT_HEADERDATA, &reply);
    // etcd's redirects are to other members' peer URLs, never a thing to follow blindly.
    curl_easy_setopt(curl.get(), CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(curl.get(), CURLOPT_PROTOCOLS_STR, "http,https");
    if (method == "PUT" || method == "POST") {
      curl_easy_setopt(curl.get(), CURLOPT_POSTFIELDS, body.c_str());
      curl_easy_setopt(curl.get(), CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
    }
    const CURLcode code = curl_easy_perform(curl.get());
    long status = 0;
    curl_easy_getinfo(curl.get(), CURLINFO_RESPONSE_CODE, &status);
    if (code == CURLE_OPERATION_TIMEDOUT && is_wait) {
      // Nothing changed within this attempt; the caller reads again (a member that is cut off
      // fails that read over) and waits on.
      EtcdResponse response;
      response.timed_out = true;
      return response;
    }
    if (code == CURLE_OK && status > 0 && status < 500) {
      EtcdResponse response;
      response.etcd_index = reply.etcd_index;
      nlohmann::json json = nlohmann::json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
      if (json.is_discarded() || !json.is_object()) {
        // A wait that etcd closed with no event (its own timeout) answers with an empty body.
        if (is_wait && reply.body.empty()) {
          response.timed_out = true;
          preferred_.store(index);
          return response;
        }
        failures[index] = "HTTP " + std::to_string(status) + " with a body that is not etcd's";
      } else if (is_write && !json.contains("errorCode") && drop_write_replies_.load() > 0 &&
                 drop_write_replies_.fetch_sub(1) > 0) {
        failures[index] = "answer dropped by the test seam after the write was applied";
        maybe_applied = true;
        if (in_the_gap_) in_the_gap_();
      } else {
        preferred_.store(index);
        response.ambiguous = maybe_applied;
        if (json.contains("errorCode")) {
          response.error_code = json.value("errorCode", -1);
          response.error_message = json.value("message", "") + " (" + json.value("cause", "") + ")";
          if (json.contains("index") && response.etcd_index == 0) response.etcd_index = json.value("index", std::uint64_t{0});
          return response;
        }
        response.action = json.value("action", "");
        if (json.contains("node")) {
          response.node = node_of(json["node"]);
          flatten(json["node"], response.children);
        }
        return response;
      }
    } else if (code != CURLE_OK) {
      failures[index] = curl_easy_strerror(code);
      // Refused or unresolved, the member never saw the write; anything later, it may have.
      if (code != CURLE_COULDNT_CONNECT && code != CURLE_COULDNT_RESOLVE_HOST) maybe_applied = maybe_applied || is_write;
    } else {
      failures[index] = "HTTP " + std::to_string(status) + " " + reply.body.substr(0, 200);
      maybe_applied = maybe_applied || is_write;  // etcd answers 5xx to a proposal it timed out on
    }
    // Once round the list: a leader election is likely under way; give it a moment.
    if ((attempt + 1) % endpoints_.size() == 0) {
      std::this_thread::sleep_for(std::min(backoff, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                        std::max(Clock::duration::zero(), deadline - Clock::now()))));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    }
    if (Clock::now() >= deadline) break;
  }
  std::string said;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    said += (i ? "; " : "") + endpoints_[i] + ": " + (failures[i].empty() ? "not tried" : failures[i]);
  }
  throw EtcdUnavailable("ddp: no etcd member answered " + method + " " + key + " within " + millis(timeout) + " (" +
                        said + "); check that the cluster runs with --enable-v2 and that a majority of its members "
                        "is up");
}

EtcdResponse EtcdV2Client::get(const std::string& key, bool recursive) {
  return request("GET", key, std::string("quorum=true") + (recursive ? "&recursive=true" : ""), "", request_timeout_,
                 false);
}

EtcdResponse EtcdV2Client::get_local(const std::string& key) {
  return request("GET", key, "", "", request_timeout_, false);
}

namespace {
std::string form(const std::string& name, const std::string& value) {
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  return name + "=" + escape(curl.get(), value);
}
std::string ttl_field(int ttl_seconds) { return ttl_seconds > 0 ? "&ttl=" + std::to_string(ttl_seconds) : ""; }
}  // namespace

EtcdResponse EtcdV2Client::set(const std::string& key, const std::string& value, int ttl_seconds) {
  return request("PUT", key, "", form("value", value) + ttl_field(ttl_seconds), request_timeout_, false);
}

EtcdResponse EtcdV2Client::create(const std::string& key, const std::string& value, int ttl_seconds) {
  return request("PUT", key, "", form("value", value) + "&prevExist=false" + ttl_field(ttl_seconds), request_timeout_,
                 false);
}

EtcdResponse EtcdV2Client::compare_and_swap(const std::string& key, const std::string& value,
                                            std::uint64_t prev_index, int ttl_seconds) {
  return request("PUT", key, "",
                 form("value", value) + "&prevIndex=" + std::to_string(prev_index) + ttl_field(ttl_seconds),
                 request_timeout_, false);
}

EtcdResponse EtcdV2Client::refresh(const std::string& key, int ttl_seconds) {
  return request("PUT", key, "", "refresh=true&prevExist=true" + ttl_field(ttl_seconds), request_timeout_, false);
}

EtcdResponse EtcdV2Client::remove(const std::string& key, bool recursive) {
  return request("DELETE", key, recursive ? "recursive=true" : "", "", request_timeout_, false);
}

EtcdResponse EtcdV2Client::compare_and_delete(const std::string& key, std::uint64_t prev_index) {
  return request("DELETE", key, "prevIndex=" + std::to_string(prev_index), "", request_timeout_, false);
}

EtcdResponse EtcdV2Client::wait(const std::string& key, std::uint64_t wait_index, std::chrono::milliseconds timeout,
                                bool recursive) {
  return request("GET", key,
                 "wait=true&waitIndex=" + std::to_string(wait_index) + (recursive ? "&recursive=true" : ""), "",
                 std::max(timeout, std::chrono::milliseconds(1)), true);
}

}  // namespace ddp::detail
