# Inputs of the podmigrate AWS testbed: 1 control-plane node + N workers in one public subnet.
# Where the study does not say (e.g. its instance types), the value is a variable with a plain default.

variable "aws_region" {
  description = "AWS region to create the testbed in."
  type        = string
  default     = "eu-central-1"
}

variable "name_prefix" {
  description = "Prefix of every resource name and of the Name tags (lower case, digits, dashes)."
  type        = string
  default     = "podmigrate"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name_prefix))
    error_message = "name_prefix must be 2-31 characters: lower-case letters, digits and dashes, starting with a letter."
  }
}

variable "tags" {
  description = "Extra tags added to every resource (on top of Project and Testbed)."
  type        = map(string)
  default     = {}
}

variable "vpc_cidr" {
  description = "CIDR block of the testbed VPC. All traffic between nodes is allowed inside it."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0))
    error_message = "vpc_cidr must be a valid IPv4 CIDR block, e.g. 10.42.0.0/16."
  }
}

variable "public_subnet_cidr" {
  description = "CIDR block of the single public subnet (must lie inside vpc_cidr)."
  type        = string
  default     = "10.42.1.0/24"

  validation {
    condition     = can(cidrhost(var.public_subnet_cidr, 0))
    error_message = "public_subnet_cidr must be a valid IPv4 CIDR block, e.g. 10.42.1.0/24."
  }
}

variable "availability_zone" {
  description = "Availability zone of the subnet; empty means the region's first available zone."
  type        = string
  default     = ""
}

variable "ssh_allowed_cidrs" {
  description = "CIDR blocks allowed to reach SSH (22) and the Kubernetes API (6443) from outside the VPC, e.g. your own address as a.b.c.d/32."
  type        = list(string)

  validation {
    condition     = length(var.ssh_allowed_cidrs) > 0 && alltrue([for c in var.ssh_allowed_cidrs : can(cidrhost(c, 0))])
    error_message = "ssh_allowed_cidrs must be a non-empty list of valid IPv4 CIDR blocks."
  }

  validation {
    condition     = !contains(var.ssh_allowed_cidrs, "0.0.0.0/0")
    error_message = "Do not open SSH and the API server to the whole Internet (0.0.0.0/0); use your own address/32."
  }
}

variable "ssh_public_key_path" {
  description = "Path of the SSH public key installed on every node (an aws_key_pair is created from it)."
  type        = string
  default     = "~/.ssh/id_ed25519.pub"
}

variable "os_image" {
  description = "Node operating system: \"ubuntu-24.04\" (CRIU >= 4.2 from the CRIU PPA) or \"debian-12\" (CRIU built from source by Ansible)."
  type        = string
  default     = "ubuntu-24.04"

  validation {
    condition     = contains(["ubuntu-24.04", "debian-12"], var.os_image)
    error_message = "os_image must be \"ubuntu-24.04\" or \"debian-12\"."
  }
}

variable "ami_owners" {
  description = "AMI owner account ID per os_image (Canonical 099720109477, Debian 136693071363)."
  type        = map(string)
  default = {
    "ubuntu-24.04" = "099720109477"
    "debian-12"    = "136693071363"
  }

  validation {
    condition     = alltrue([for id in values(var.ami_owners) : can(regex("^[0-9]{12}$", id))])
    error_message = "Every AMI owner must be a 12-digit AWS account ID."
  }
}

variable "ami_id" {
  description = "Use this AMI instead of the newest one found for os_image (empty: look it up)."
  type        = string
  default     = ""

  validation {
    condition     = var.ami_id == "" || can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "ami_id must be empty or look like ami-0123456789abcdef0."
  }
}

variable "control_plane_instance_type" {
  description = "EC2 instance type of the control-plane node (the study does not name its types; m5.large is a plain default)."
  type        = string
  default     = "m5.large"
}

variable "worker_instance_type" {
  description = "EC2 instance type of the workers, which run the migrated pods and hold checkpoint images (set it to the study's type if known)."
  type        = string
  default     = "m5.xlarge"
}

variable "worker_count" {
  description = "Number of worker nodes (the study used 2: a migration needs a source and a target)."
  type        = number
  default     = 2

  validation {
    condition     = var.worker_count >= 2 && var.worker_count <= 10 && floor(var.worker_count) == var.worker_count
    error_message = "worker_count must be a whole number from 2 to 10 (a migration needs two workers)."
  }
}

variable "root_volume_gb" {
  description = "Root volume size (GiB, gp3) of every node; checkpoint archives, checkpoint images and the registry need room."
  type        = number
  default     = 60

  validation {
    condition     = var.root_volume_gb >= 30 && var.root_volume_gb <= 1024
    error_message = "root_volume_gb must be between 30 and 1024 GiB."
  }
}

variable "worker_spot" {
  description = "Run the workers as Spot instances (the study's scenario: migrate away within the 2-minute Spot interruption notice)."
  type        = bool
  default     = false
}

variable "spot_max_price" {
  description = "Maximum hourly Spot price in USD for the workers (empty: capped at the on-demand price). Only used when worker_spot is true."
  type        = string
  default     = ""

  validation {
    condition     = var.spot_max_price == "" || can(tonumber(var.spot_max_price))
    error_message = "spot_max_price must be empty or a number such as \"0.10\"."
  }
}

variable "inventory_path" {
  description = "Where to write the generated Ansible inventory (empty: ../ansible/inventory.aws.ini next to the playbooks)."
  type        = string
  default     = ""
}
